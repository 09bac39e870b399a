"""Real deployment: certificates, node-configs, backend settings and a TLS + auth federation."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding

from fedapp.config import ConfigError, resolve_config
from fedapp.run.deploy import node_config_arg, node_configs, parse_node_config, validate_nodes
from fedapp.run.processes import simulation_backend


def _make_certs():
    spec = importlib.util.spec_from_file_location("make_certs", REPO / "scripts" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_certificates_chain_to_the_ca_and_keys_are_p384_openssh(tmp_path) -> None:
    paths = _make_certs().make_all(tmp_path, ("127.0.0.1", "localhost", "superlink.example"), supernodes=2)
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    assert cert.issuer == ca.subject
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                           cert.signature_hash_algorithm)  # raises if not signed by the CA
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink.example" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = serialization.load_ssh_private_key(paths["supernode-1"].read_bytes(), None)
    pub = serialization.load_ssh_public_key(paths["supernode-1.pub"].read_bytes())
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert pub.public_numbers() == key.public_key().public_numbers()
    assert (paths["key"].stat().st_mode & 0o777) == 0o600 and (paths["supernode-0"].stat().st_mode & 0o777) == 0o600


def test_node_configs_parse_and_validate() -> None:
    nodes = node_configs(3, ["0:epsilon=0.5 batch-size=16", "2:dataset=\"digits\" delta=1e-5"])
    assert nodes[0] == {"partition-id": 0, "num-partitions": 3, "epsilon": 0.5, "batch-size": 16}
    assert nodes[2]["dataset"] == "digits" and nodes[2]["delta"] == 1e-5
    assert node_config_arg(nodes[0]) == "partition-id=0 num-partitions=3 epsilon=0.5 batch-size=16"
    cfg = resolve_config(overrides={"batch-size": 8})
    validate_nodes(cfg.general, cfg.training, cfg.data, nodes)
    with pytest.raises(ConfigError, match="unknown node-config key 'epsilom'"):
        parse_node_config("epsilom=1")
    with pytest.raises(ConfigError, match="node-config 'batch-size' expects int, got 'big'"):
        parse_node_config("batch-size=big")
    with pytest.raises(ConfigError, match="SuperNode 5 does not exist"):
        node_configs(3, ["5:epsilon=1"])
    with pytest.raises(ConfigError, match="at least 2 SuperNodes"):
        node_configs(1)
    default = resolve_config()
    with pytest.raises(ConfigError, match="dataset 'mnist' differs from run-config dataset 'digits'"):
        validate_nodes(default.general, default.training, default.data, node_configs(2, ["1:dataset=mnist"]))
    with pytest.raises(ConfigError, match="client 1: epsilon = -1.0 must be > 0"):
        validate_nodes(default.general, default.training, default.data, node_configs(2, ["1:epsilon=-1"]))


def test_simulation_backend_fractional_gpus_and_ray_cluster() -> None:
    backend, env = simulation_backend(num_cpus=2, num_gpus=0.25)
    assert backend["client_resources"] == {"num_cpus": 2, "num_gpus": 0.25} and env == {}
    backend, env = simulation_backend(num_gpus=2, ray_address="ray://10.0.0.5:10001")
    assert backend["init_args"]["address"] == "ray://10.0.0.5:10001" and env == {"RAY_ADDRESS": "ray://10.0.0.5:10001"}
    assert simulation_backend(ray_address="auto")[1]["RAY_ADDRESS"] == "auto"
    assert simulation_backend(ray_address="head-node:6379")[0]["init_args"]["address"] == "head-node:6379"
    with pytest.raises(ConfigError, match="num-gpus = 1.5"):
        simulation_backend(num_gpus=1.5)
    with pytest.raises(ConfigError, match="num-cpus = 0"):
        simulation_backend(num_cpus=0)
    with pytest.raises(ConfigError, match="ray address 'http://x'"):
        simulation_backend(ray_address="http://x")


@pytest.mark.slow
def test_tls_authenticated_federation_of_three_supernodes(tmp_path) -> None:
    import psutil

    from fedapp.run.deploy import deploy

    out = tmp_path / "results"
    res = deploy(3, f"strategy='robust-hdp' num-server-rounds=2 max-samples=300 batch-size=16 "
                    f"fraction-evaluate=0.0 output-dir='{out}'",
                 node_overrides=["0:epsilon=0.8 dataset='digits'"], unauthorized=1, work_dir=tmp_path / "work",
                 timeout=480, outsider=True, log=lambda *_: None)
    # the outsider holds only ca.crt and the public (gateway) address: each Control API action is refused ...
    # ... and so is the Control API reached by path traversal through the gateway
    assert res.outsider == {"register": "refused", "ls": "refused", "run": "refused", "traversal-dots": "refused",
                            "traversal-encoded": "refused", "traversal-slash": "refused"}, res.outsider
    assert "403" in (res.work_dir / "outsider-register.log").read_text() or "not served" in (
        res.work_dir / "outsider-register.log").read_text()
    assert not list((res.work_dir / "certs").glob("ca.key")) and not list(res.work_dir.rglob("ca.key"))
    assert res.run_dir.parent == out
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_completed"] == 2
    config = json.loads((res.run_dir / "config.json").read_text())
    assert config["config"]["strategy"] == "robust-hdp" and config["config"]["num-clients"] == 3
    rounds = [json.loads(line) for line in (res.run_dir / "rounds.jsonl").read_text().splitlines()]
    for rec in rounds:
        assert sorted(c["client_id"] for c in rec["clients"]) == [0, 1, 2]  # the intruder never took part
        assert all(c["status"] == "ok" for c in rec["clients"])
        assert all(c["epsilon_spent"] <= c["epsilon_budget"] * (1 + 1e-9) for c in rec["clients"])
    client0 = next(c for c in rounds[-1]["clients"] if c["client_id"] == 0)
    assert client0["epsilon_budget"] == 0.8  # its --node-config reached the SuperNode
    assert res.refused == ["unauthorized-0"]
    superlink_log = "".join(f.read_text() for f in (res.work_dir / "flwr-home").glob("superlink-*.out"))
    assert "Uvicorn running on https://127.0.0.1" in superlink_log  # served TLS only
    assert res.leftover_pids == []
    alive = [pid for pid in res.pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes left running: {alive}"
    assert len(res.pids) >= 6  # SuperLink + gateway + 3 SuperNodes + intruder at least


@pytest.mark.slow
def test_dp_ftrl_under_secagg_in_a_deployment_spends_the_recomputed_epsilon(tmp_path) -> None:
    """DP-FTRL's client-side noise streams live in each SuperNode's Context.state across rounds (a ClientApp process
    per message in a deployment); under SecAgg+ every round's sum holds all three streams and ε against the server is
    the factorization's, recomputed here from the encoder and the analytic Gaussian mechanism."""
    import numpy as np
    from conftest import analytic_gaussian_epsilon

    from fedapp.privacy.profiles import ftrl_mechanism
    from fedapp.run.deploy import deploy
    from fedapp.run.processes import to_toml_assignments
    from strategies.privacy.ftrl_accounting import run_factorization

    ov = {"strategy": "dp-ftrl", "secure-aggregation": True, "secagg-mechanism": "gaussian", "num-server-rounds": 3,
          "privacy-dist": "fixed", "batch-size": 16, "local-steps": 2, "clip-norm": 1.0, "target-epsilon": 4.0,
          "fraction-evaluate": 0.0, "max-samples": 400, "ftrl-bands": 2}
    res = deploy(3, to_toml_assignments({**ov, "output-dir": str(tmp_path / "results")}), work_dir=tmp_path / "work",
                 timeout=480, log=lambda *_: None)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_completed"] == 3 and res.leftover_pids == []
    cfg = resolve_config({}, ov)
    m = ftrl_mechanism(cfg.general, cfg.training, cfg.client_dp, 3)
    f = run_factorization(m.kind, m.rounds, m.bands, m.restart_every)
    for rec in (json.loads(line) for line in (res.run_dir / "rounds.jsonl").read_text().splitlines()):
        t = rec["round"]
        c = f.encoder[f.row_round < t][:, :t]
        eps = analytic_gaussian_epsilon(m.noise_multiplier / float(np.linalg.norm(c @ np.ones(t))), m.delta)
        assert rec["metrics"]["secure_aggregation"] is True and rec["metrics"]["clients_present"] == 3
        assert [c["status"] for c in rec["clients"]] == ["ok"] * 3
        assert all(c["epsilon_vs_server"] == pytest.approx(eps, rel=0.01) for c in rec["clients"])
    assert 3.9 <= summary["max_epsilon_vs_server"] <= 4.0


@pytest.mark.slow
def test_supernodes_enforce_their_own_privacy_policy_whatever_the_run_config_says(tmp_path) -> None:
    """The run-config (the submitter's) asks for seeded noise, which voids every guarantee: the SuperNodes with default
    node-config refuse to train, in their own ClientApp processes, naming the node-config key; the one whose operator
    allowed it trains. The launcher's own pre-check (which would refuse this before starting) is skipped here."""
    from fedapp.run.deploy import deploy

    res = deploy(3, f"strategy='dpsgd-fedavg' seeded-noise=true num-server-rounds=2 max-samples=300 batch-size=16 "
                    f"fraction-evaluate=0.0 output-dir='{tmp_path / 'results'}'",
                 node_overrides=["0:allow-seeded-noise=true"], work_dir=tmp_path / "work", timeout=480,
                 log=lambda *_: None, check_policies=False)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_completed"] == 2 and res.leftover_pids == []
    for rec in (json.loads(line) for line in (res.run_dir / "rounds.jsonl").read_text().splitlines()):
        by_id = {c["client_id"]: c for c in rec["clients"]}
        assert by_id[0]["status"] == "ok"
        for cid in (1, 2):
            assert by_id[cid]["status"] == "refused" and "allow-seeded-noise" in by_id[cid]["reason"]
