"""loom.testbed without root: topology, addresses, routes, planner export, launch line, CLI, refusals."""

import ipaddress
import json
import shutil

import pytest

from loom.testbed import Testbed, TestbedSpec, TestbedUnavailable, preflight, rank_env, ranks, static_path
from loom.testbed import topology_dict
from loom.testbed import cli, netns
from loom.testbed.probe import CLASSES, class_pairs, configured_gbit

SPECS = [TestbedSpec(nodes=n, ranks_per_node=r, rails=k, rail_gbit=1, intra_gbit=10)
         for n, r, k in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2), (3, 4, 2), (4, 4, 4), (2, 3, 2)]]


@pytest.mark.parametrize("kw,err,match", [
    ({"rails": 3, "ranks_per_node": 2}, ValueError, "rails=3 exceeds ranks_per_node=2"),
    ({"nodes": 0}, ValueError, "nodes=0 must be >= 1"),
    ({"rail_gbit": -1}, ValueError, "rail_gbit=-1 must be >= 0"),
    ({"intra_gbit": 0.0001}, ValueError, "below tc's useful range"),
    ({"nodes": 2.0}, TypeError, "nodes=2.0 must be an int"),
    ({"ranks_per_node": True}, TypeError, "must be an int"),
    ({"rail_gbit": "1"}, TypeError, "rail_gbit='1' must be a number"),
    ({"nodes": 9, "ranks_per_node": 8}, ValueError, "72 ranks exceeds 64"),
])
def test_spec_validation(kw, err, match):
    with pytest.raises(err, match=match):
        TestbedSpec(**kw)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_placement_and_addresses(spec):
    infos = ranks(spec)
    assert [i.rank for i in infos] == list(range(spec.size))
    rail_ips = [ipaddress.ip_address(i.rail_ip) for i in infos]
    assert len(set(rail_ips)) == spec.size
    for i in infos:
        assert (i.node, i.local_rank) == divmod(i.rank, spec.ranks_per_node)
        assert i.rail == i.local_rank % spec.rails
        assert ipaddress.ip_address(i.rail_ip) in ipaddress.ip_network(f"10.200.{i.rail}.0/24")
        if spec.ranks_per_node == 1:
            assert i.intra_ip is None and not i.routes
        else:
            assert ipaddress.ip_address(i.intra_ip) in ipaddress.ip_network(f"10.200.{100 + i.node}.0/24")
        for r in i.routes:  # every route leaves by the intra NIC from the rail address, via a same-node rank
            assert r.dev == "intra" and r.src == i.rail_ip
            via = next(j for j in infos if j.intra_ip == r.via)
            assert via.node == i.node and via.rank != i.rank


def _route_for(spec, src, dst):
    """Longest-prefix match of dst's rail address in src's route table (None: the connected rail subnet)."""
    info, target = ranks(spec)[src], ipaddress.ip_address(ranks(spec)[dst].rail_ip)
    best = None
    for r in info.routes:
        net = ipaddress.ip_network(r.dest)
        if target in net and (best is None or net.prefixlen > ipaddress.ip_network(best.dest).prefixlen):
            best = r
    return best


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_routes_match_static_paths(spec):
    """The kernel routes installed and the exported static paths describe the same forwarding."""
    infos = ranks(spec)
    for s in range(spec.size):
        for d in range(spec.size):
            if s == d:
                continue
            path = static_path(spec, s, d)
            assert path[0] == f"r{s}" and path[-1] == f"r{d}"
            r = _route_for(spec, s, d)
            same_node = infos[s].node == infos[d].node
            if r is None:  # connected rail subnet: direct over the shared rail switch
                assert not same_node and infos[s].rail == infos[d].rail
                assert path == [f"r{s}", f"rail{infos[s].rail}", f"r{d}"]
            elif same_node:
                assert r.via == infos[d].intra_ip and path == [f"r{s}", f"node{infos[s].node}", f"r{d}"]
            else:  # cross-rail: first hop is the source node's rank on the destination's rail
                hop = next(j for j in infos if j.intra_ip == r.via)
                assert hop.rail == infos[d].rail
                assert path == [f"r{s}", f"node{infos[s].node}", f"r{hop.rank}", f"rail{infos[d].rail}", f"r{d}"]


def test_static_path_examples_and_errors():
    spec = TestbedSpec(nodes=2, ranks_per_node=2, rails=2)
    assert static_path(spec, 0, 3) == ["r0", "node0", "r1", "rail1", "r3"]
    assert static_path(spec, 3, 0) == ["r3", "node1", "r2", "rail0", "r0"]  # the reply's mirror route
    assert static_path(spec, 0, 2) == ["r0", "rail0", "r2"]
    assert static_path(spec, 1, 0) == ["r1", "node0", "r0"]
    with pytest.raises(ValueError, match="dst=4 is not a rank"):
        static_path(spec, 0, 4)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_topology_dict_schema(spec):
    d = json.loads(json.dumps(topology_dict(spec)))  # JSON round trip
    assert d["schema"] == "loom.testbed.topology/1"
    assert [n["ranks"] for n in d["nodes"]] == [list(range(n * spec.ranks_per_node, (n + 1) * spec.ranks_per_node))
                                                for n in range(spec.nodes)]
    verts = {f"r{g}" for g in range(spec.size)} | {s["id"] for s in d["switches"]}
    links = {frozenset((lk["a"], lk["b"])): lk for lk in d["links"]}
    for lk in d["links"]:
        assert lk["a"] in verts and lk["b"] in verts
        assert lk["capacity"] == pytest.approx((1e9 if lk["kind"] == "rail" else 10e9) / 8)
    assert len(d["routes"]) == spec.size * (spec.size - 1)
    for path in d["routes"].values():  # every step of every route is a link
        for a, b in zip(path[:-1], path[1:]):
            assert frozenset((a, b)) in links, (path, a, b)


def test_topology_dict_unlimited_is_none():
    d = topology_dict(TestbedSpec(nodes=2, ranks_per_node=2, rails=1, rail_gbit=0, intra_gbit=0))
    assert all(lk["capacity"] is None for lk in d["links"])


def test_multipath_reads_the_export():
    mp = pytest.importorskip("loom.multipath.topology")
    spec = TestbedSpec(nodes=2, ranks_per_node=2, rails=2, rail_gbit=1, intra_gbit=10)
    topo = mp.Topology.from_dict(topology_dict(spec))
    for s in range(spec.size):
        for d in range(spec.size):
            if s != d:
                assert list(topo.static_route(s, d)) == static_path(spec, s, d)


def test_probe_classes():
    topo = topology_dict(TestbedSpec(nodes=2, ranks_per_node=2, rails=2, rail_gbit=0.5, intra_gbit=0))
    assert class_pairs(topo, "intra") == [(0, 1)]
    assert class_pairs(topo, "rail") == [(0, 2)]
    assert class_pairs(topo, "cross") == [(0, 3)]
    assert class_pairs(topo, "rails") == [(0, 2), (1, 3)]
    assert [configured_gbit(topo, c) for c in CLASSES] == [0.0, 0.5, 0.5, 1.0]
    one = topology_dict(TestbedSpec(nodes=2, ranks_per_node=1, rails=1))
    assert [class_pairs(one, c) for c in CLASSES] == [[], [(0, 1)], [], []]
    with pytest.raises(ValueError, match="unknown link class 'x'"):
        class_pairs(one, "x")


def test_rank_env_and_mpmd_launch_line():
    spec = TestbedSpec(nodes=2, ranks_per_node=2, rails=2)
    env = rank_env(spec, 3, "/tmp/t.json")
    assert env["FI_TCP_IFACE"] == env["GLOO_SOCKET_IFNAME"] == "rail" and env["MPIR_CVAR_NOLOCAL"] == "1"
    assert env["FI_PROVIDER"] == "tcp"
    assert (env["LOOM_TESTBED_NODE"], env["LOOM_TESTBED_LOCAL_RANK"], env["LOOM_TESTBED_RAIL"]) == ("1", "1", "1")
    tb = Testbed(spec)  # building needs root; describing the launch does not
    argv = tb.mpiexec_argv(["python", "x.py"], env={"A": "1"})
    segments = " ".join(argv[1:]).split(" : ")
    assert len(segments) == 4
    for g, seg in enumerate(segments):
        # each emulated node gets its own host name (unshare --uts), so topology detection sees the nodes
        assert seg.startswith(f"-n 1 ip netns exec {tb.rank_ns(g)} unshare --uts ") and seg.endswith("A=1 python x.py")
        assert f" loomtb-node{g // 2} env " in seg
        assert f"LOOM_TESTBED_NODE={g // 2} " in seg
    with pytest.raises(ValueError, match="empty command"):
        tb.mpiexec_argv([])
    with pytest.raises(netns.TestbedError, match="not built"):
        tb.run(["true"])
    with pytest.raises(TypeError, match="not both"):
        Testbed(spec, nodes=2)


def test_current_topology(monkeypatch, tmp_path):
    from loom.testbed import current_topology

    monkeypatch.delenv("LOOM_TESTBED_TOPOLOGY", raising=False)
    assert current_topology() is None
    want = topology_dict(TestbedSpec(nodes=2, ranks_per_node=2, rails=2))
    (tmp_path / "t.json").write_text(json.dumps(want))
    monkeypatch.setenv("LOOM_TESTBED_TOPOLOGY", str(tmp_path / "t.json"))
    assert current_topology() == want


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedUnavailable, match="needs root"):
        preflight()
    with pytest.raises(TestbedUnavailable, match="needs root"):
        Testbed(nodes=2).build()
    assert cli.main(["run", "--", "true"]) == 77


def test_refuses_without_tc(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    real = shutil.which
    monkeypatch.setattr(netns.shutil, "which", lambda name: None if name == "tc" else real(name))
    with pytest.raises(TestbedUnavailable, match="needs tc from iproute2"):
        preflight()


def test_cli_show_dry_run_and_errors(capsys):
    assert cli.RELAUNCH is False
    assert cli.main(["show", "-N", "2", "-R", "2", "-K", "2", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == topology_dict(TestbedSpec(nodes=2, ranks_per_node=2, rails=2))
    assert cli.main(["show", "-N", "2", "-R", "2", "-K", "2"]) == 0
    assert "via 10.200.100.2 dev intra src 10.200.0.1" in capsys.readouterr().out
    assert cli.main(["run", "--dry-run", "-N", "2", "--", "python", "x.py"]) == 0
    assert " : -n 1 ip netns exec " in capsys.readouterr().out
    assert cli.main(["run", "-N", "2", "-R", "1", "-K", "2", "--", "true"]) == 2
    assert "rails=2 exceeds ranks_per_node=1" in capsys.readouterr().err
    assert cli.main(["run", "--dry-run"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])


def test_check_table_and_verdicts(capsys):
    def row(cls, conf, got, pairs=1):
        return {"class": cls, "path": "r0 rail0 r1", "configured_gbit": conf, "achieved_gbit": got,
                "latency_us": 12.5, "pairs": [[0, 1]] * pairs}

    rows = [row("rail", 1.0, 0.95), row("intra", 10.0, 1.5), row("rails", 2.0, 0.5, pairs=2),
            row("no-limit", 0.0, 1.6)]
    cli.print_table(rows, TestbedSpec(nodes=2, ranks_per_node=2, rails=2))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# OSU-style loom Testbed Link Check"
    body = {line.split()[0]: line.split() for line in out if not line.startswith("#")}
    assert body["rail"][-3:] == ["0.95", "12.50", "link"]
    assert body["intra"][-1] == "cpu"  # 1.5 of 10 configured, but >= 70 % of the 1.6 Gbit/s ceiling
    assert body["rails"][-1] == "low"  # 0.25 per flow: neither the link nor the CPU explains it
    assert body["no-limit"][-5:] == ["unlimited", "1.600", "-", "12.50", "-"]


def test_set_rail_rate_rejects_bad_input(monkeypatch):
    from loom.testbed import TestbedError, set_rail_rate, topology_dict
    from loom.testbed.topology import TestbedSpec

    monkeypatch.delenv("LOOM_TESTBED_TOPOLOGY", raising=False)
    with pytest.raises(TestbedError, match="no running testbed"):
        set_rail_rate(0, 0.1)
    topo = {**topology_dict(TestbedSpec(nodes=2, ranks_per_node=2, rails=2)), "prefix": "loomtb-none-"}
    with pytest.raises(ValueError, match="rails 0..1"):
        set_rail_rate(2, 0.1, topology=topo)
    with pytest.raises(ValueError, match="> 0"):
        set_rail_rate(0, 0, topology=topo)
