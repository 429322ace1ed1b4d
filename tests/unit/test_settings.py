"""loom.settings: one declaration per LOOM_* variable, one boolean parser, explicit > env > Dask config > default."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from loom import settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("word,value", [("1", True), ("true", True), ("YES", True), (" On ", True),
                                        ("0", False), ("False", False), ("no", False), ("OFF", False)])
def test_parse_bool_accepts_the_four_spellings(word, value):
    assert settings.parse_bool(word, "LOOM_X") is value


@pytest.mark.parametrize("word", ["", "2", "enable", "y", "nope"])
def test_parse_bool_rejects_anything_else_naming_the_variable(word):
    with pytest.raises(ValueError, match=r"LOOM_X=.*1/0, true/false, yes/no, on/off"):
        settings.parse_bool(word, "LOOM_X")


def test_doorbell_false_turns_it_off(monkeypatch):
    for word in ("false", "0", "off", "No"):
        monkeypatch.setenv("LOOM_DOORBELL", word)
        assert settings.get("doorbell") is False
    monkeypatch.setenv("LOOM_DOORBELL", "maybe")
    with pytest.raises(ValueError, match="LOOM_DOORBELL='maybe'"):
        settings.get("doorbell")


def test_doorbell_module_honours_false(monkeypatch):
    from loom.comm import doorbell

    monkeypatch.setenv("LOOM_DOORBELL", "false")
    monkeypatch.setattr(doorbell, "_DOORBELL", None)
    assert doorbell.get() is None


def test_precedence_explicit_env_default(monkeypatch):
    monkeypatch.delenv("LOOM_TIMEOUT", raising=False)
    assert settings.get("timeout") is None
    monkeypatch.setenv("LOOM_TIMEOUT", "30")
    assert settings.get("timeout") == 30.0
    assert settings.get("timeout", 5) == 5.0
    with settings.override(timeout=7):
        assert settings.get("timeout") == 7.0
        assert settings.get("timeout", 5) == 5.0
    assert settings.get("timeout") == 30.0
    monkeypatch.setenv("LOOM_TIMEOUT", "")  # empty counts as unset
    assert settings.get("timeout") is None
    assert settings.get("timeout", fallback=9) == 9


def test_dask_config_between_environment_and_default(monkeypatch):
    dask_config = pytest.importorskip("dask.config")
    monkeypatch.delenv("LOOM_DASK_SPIN_US", raising=False)
    assert sys.modules.get("dask.config") is dask_config
    assert settings.get("dask_spin_us") is None
    with dask_config.set({"distributed.comm.mpi.spin-us": 25}):
        assert settings.get("dask_spin_us") == 25.0
        monkeypatch.setenv("LOOM_DASK_SPIN_US", "40")
        assert settings.get("dask_spin_us") == 40.0
        assert settings.get("dask_spin_us", 3) == 3.0
    with dask_config.set({"distributed.comm.mpi.spin-us": -1}):
        monkeypatch.delenv("LOOM_DASK_SPIN_US")
        with pytest.raises(ValueError, match="distributed.comm.mpi.spin-us=-1 must be >= 0"):
            settings.get("dask_spin_us")


def test_dask_defaults_cover_every_dask_key():
    mpi = settings.dask_defaults()["distributed"]["comm"]["mpi"]
    keys = {s.dask_key for s in settings.SETTINGS.values() if s.dask_key}
    assert {f"distributed.comm.mpi.{k}" for k in mpi} == keys


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown loom setting 'doorbel'; valid: check, timeout"):
        settings.get("doorbel")
    with pytest.raises(AttributeError, match="valid: check"):
        _ = settings.rc.doorbel
    with pytest.raises(AttributeError, match="valid: check"):
        settings.rc.doorbel = False
    with pytest.raises(ValueError, match="unknown loom setting"):
        with settings.override(nope=1):
            pass


def test_rc_reads_and_overrides(monkeypatch):
    monkeypatch.setenv("LOOM_CHECK", "1")
    assert settings.rc.check is True
    settings.rc.check = "off"
    try:
        assert settings.get("check") is False
    finally:
        settings.rc.check = None
    assert settings.rc.check is True


@pytest.mark.parametrize("name,raw,rule", [("timeout", "-1", "must be > 0"), ("timeout", "soon", "not a number"),
                                           ("attn_kernel", "fast", "valid: auto, flash, torch"),
                                           ("progress", "fancy", "valid: auto, bar, lines, none"),
                                           ("threads", "0", "must be >= 1"), ("threads", "two", "not an integer")])
def test_bad_values_name_the_variable_and_rule(monkeypatch, name, raw, rule):
    s = settings.SETTINGS[name]
    monkeypatch.setenv(s.env, raw)
    with pytest.raises(ValueError, match=re.escape(f"{s.env}={raw!r}") + ".*" + re.escape(rule)):
        settings.get(name)


def test_only_is_a_list(monkeypatch):
    monkeypatch.setenv("LOOM_ONLY", "check_a, check_b,,")
    assert settings.get("only") == ("check_a", "check_b")


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}, (2, 4, 4, "mpich")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
     (1, 3, 3, "openmpi")),
    ({"PMIX_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"}, (5, 8, None, "pmix")),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"}, (3, 4, None, "slurm")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, None),  # a batch script's shell is not a rank
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, None),
])
def test_launch_info_from_any_launcher(env, expected):
    info = settings.launch_info(env)
    got = None if info is None else (info.rank, info.size, info.local_size, info.launcher)
    assert got == expected
    assert settings.launch_rank(env) == (0 if expected is None else expected[0])


def test_settings_page_table_is_generated_from_the_declarations():
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert settings.markdown_table() in page
    for s in settings.SETTINGS.values():
        assert f"| `{s.env}` |" in page


def _measures():
    """scripts/measures.py, whose finder of LOOM_* reads this test shares."""
    spec = importlib.util.spec_from_file_location("measures", ROOT / "scripts" / "measures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_loom_variable_is_read_outside_the_settings_module():
    reads = _measures().env_reads_outside_settings(ROOT)
    assert reads == [], f"read these through loom.settings.get(...): {reads}"


def test_the_read_finder_can_fail(tmp_path):
    (tmp_path / "loom").mkdir()
    (tmp_path / "loom" / "settings.py").write_text('import os\nA = os.environ.get("LOOM_X")\n')
    (tmp_path / "loom" / "bad.py").write_text(
        'import os\nA = os.environ.get("LOOM_X")\nB = os.environ["LOOM_Y"]\nC = "LOOM_Z" in os.environ\n'
        'D = os.getenv("LOOM_W")\nos.environ["LOOM_SET"] = "1"\n')
    assert _measures().env_reads_outside_settings(tmp_path) == [f"loom/bad.py:{n}" for n in (2, 3, 4, 5)]


def test_a_declaration_is_checked():
    with pytest.raises(ValueError, match="kind 'path'; valid: bool, int"):
        settings.Setting("x", "path", None, "a file")
    with pytest.raises(ValueError, match="default 'fast' is not one of"):
        settings.Setting("x", "str", "fast", "a mode", choices=("auto", "slow"))
