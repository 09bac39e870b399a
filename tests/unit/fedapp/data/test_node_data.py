"""run-config ``dataset = "node-local"``: each node reads its own node-config ``data-path`` (npz, CSV, Parquet, a Hugging
Face save_to_disk folder, an image folder), checks it against the run-config schema and splits it by the run's seed;
every refusal names the node-config key, and a node whose data does not fit refuses instead of failing the run."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import Code, Context, EvaluateIns, FitIns, Parameters, RecordDict

from fedapp.config import ConfigError, resolve_config
from fedapp.data.node_data import NodeDataError, node_arrays, node_splits, run_schema

RUN = {"dataset": "node-local", "input-shape": "[16]", "num-classes": 3, "model": "logreg", "strategy": "robust-hdp"}


def _blobs(n: int, seed: int = 0, features: int = 16, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    return rng.normal(size=(n, features)).astype(np.float32) + y[:, None], y


def _node(path, cid: int = 0, n: int = 3, **extra) -> dict:
    return {"partition-id": cid, "num-partitions": n, "data-path": str(path), **extra}


def _schema(**run):
    return run_schema(resolve_config({**RUN, **run}).data)


def test_npz_csv_parquet_and_saved_hf_folders_read_the_same_examples(tmp_path) -> None:
    import datasets
    import pandas as pd

    x, y = _blobs(40)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(16)]).assign(label=y)
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.rename(columns={"label": "diagnosis"}).to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_pandas(frame).save_to_disk(str(tmp_path / "hf"))
    schema = _schema()
    for path, extra in ((tmp_path / "d.npz", {}), (tmp_path / "d.csv", {}),
                        (tmp_path / "d.parquet", {"label-column": "diagnosis"}), (tmp_path / "hf", {})):
        got_x, got_y = node_arrays(_node(path, **extra), schema)
        assert got_x.dtype == np.float32 and got_y.dtype == np.int64
        np.testing.assert_allclose(got_x, x, rtol=1e-6)
        np.testing.assert_array_equal(got_y, y)


def test_image_folders_by_number_and_by_name(tmp_path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for root, names in (("numbered", ["0", "2"]), ("named", ["cat", "dog", "owl"])):
        for name in names:
            (tmp_path / root / name).mkdir(parents=True)
            for k in range(2):
                Image.fromarray(rng.integers(0, 256, (6, 6), dtype=np.uint8)).save(tmp_path / root / name / f"{k}.png")
    schema = _schema(**{"input-shape": "[1, 6, 6]", "model": "logreg"})
    x, y = node_arrays(_node(tmp_path / "numbered"), schema)  # a node holding classes 0 and 2 only
    assert x.shape == (4, 1, 6, 6) and 0 <= x.min() and x.max() <= 1 and sorted(y) == [0, 0, 2, 2]
    x, y = node_arrays(_node(tmp_path / "named"), schema)
    assert sorted(y) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(NodeDataError, match=r"2 class subfolders do not match run-config 'num-classes' = 3"):
        (tmp_path / "named" / "owl").rename(tmp_path / "owl-out")
        node_arrays(_node(tmp_path / "named"), schema)


def test_flat_rows_reshape_to_the_schema_and_splits_follow_the_seed(tmp_path) -> None:
    x, y = _blobs(50, features=64)
    np.savez(tmp_path / "flat.npz", x=x, y=y)
    cfg = resolve_config({**RUN, "input-shape": "[1, 8, 8]", "model": "cnn-digits"})
    node = _node(tmp_path / "flat.npz", cid=1)
    train, val, test = node_splits(node, cfg.data, 7, 1)
    assert train.input_shape == (1, 8, 8) and len(train) + len(val) + len(test) == 50 and len(test) == 10
    again, _, _ = node_splits(node, cfg.data, 7, 1)
    other, _, _ = node_splits(node, cfg.data, 8, 1)
    np.testing.assert_array_equal(train.y, again.y)
    assert not np.array_equal(train.x, other.x)


@pytest.mark.parametrize(("write", "node_extra", "match"), [
    (lambda p: np.savez(p / "d.npz", x=_blobs(20, features=5)[0], y=_blobs(20)[1]), {},
     r"node-config 'data-path' = .*inputs have shape \(5,\), but run-config 'input-shape' is \[16\]"),
    (lambda p: np.savez(p / "d.npz", x=_blobs(20)[0], y=_blobs(20)[1] + 1), {},
     r"labels span 1\.\.3, outside 0\.\.2 of run-config 'num-classes' = 3"),
    (lambda p: np.savez(p / "d.npz", x=_blobs(20)[0], y=_blobs(20)[1] + 0.5), {}, r"labels must be integers"),
    (lambda p: np.savez(p / "d.npz", inputs=_blobs(20)[0], y=_blobs(20)[1]), {}, r"not 'x' and 'y'"),
    (lambda p: np.savez(p / "d.npz", x=np.full((20, 16), np.nan), y=_blobs(20)[1]), {}, r"not all finite"),
    (lambda p: (p / "d.npz").write_text("x"), {"data-path": "elsewhere.npz"}, r"no such file or folder on this node"),
    (lambda p: (p / "d.npz").write_text("not a zip"), {}, r"cannot be read"),
    (lambda p: (p / "d.npz").write_text("x"), {"data-path": ""}, r"node-config 'data-path' is not set"),
])
def test_each_mismatch_is_refused_naming_the_node_config_key(tmp_path, write, node_extra, match) -> None:
    write(tmp_path)
    with pytest.raises(NodeDataError, match=match):
        node_arrays({**_node(tmp_path / "d.npz"), **node_extra}, _schema())


def test_csv_label_column_and_formats_are_named(tmp_path) -> None:
    import pandas as pd

    x, y = _blobs(20)
    pd.DataFrame(x).assign(target=y).to_csv(tmp_path / "d.csv", index=False)
    with pytest.raises(NodeDataError, match=r"label column 'label'.*node-config 'label-column'"):
        node_arrays(_node(tmp_path / "d.csv"), _schema())
    assert len(node_arrays(_node(tmp_path / "d.csv", **{"label-column": "target"}), _schema())[1]) == 20
    pd.DataFrame({"text": ["a"] * 20, "label": y}).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(NodeDataError, match=r"feature columns must be numeric; not numeric: \['text'\]"):
        node_arrays(_node(tmp_path / "t.csv"), _schema())
    (tmp_path / "d.json").write_text("{}")
    with pytest.raises(NodeDataError, match=r"format is not known"):
        node_arrays(_node(tmp_path / "d.json"), _schema())


def test_a_node_whose_data_does_not_fit_refuses_every_request_naming_why(tmp_path) -> None:
    from fedapp.apps.client_app import node_client

    np.savez(tmp_path / "d.npz", x=_blobs(30, features=4)[0], y=_blobs(30)[1])
    ctx = Context(run_id=0, node_id=1, node_config=_node(tmp_path / "d.npz", cid=2), state=RecordDict(), run_config=RUN)
    client = node_client(ctx)
    empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
    fit = client.fit(FitIns(empty, {"server-round": 1}))
    assert fit.status.code == Code.OK and fit.num_examples == 0 and fit.metrics["status"] == "refused"
    assert fit.metrics["client_id"] == 2 and "node-config 'data-path'" in str(fit.metrics["reason"])
    ev = client.evaluate(EvaluateIns(empty, {}))
    assert ev.num_examples == 0 and ev.metrics["status"] == "refused"


def test_a_node_trains_on_its_own_file_and_caps_a_drawn_batch(tmp_path) -> None:
    from fedapp.clients.common import setup_client

    for cid, n in enumerate((25, 60)):
        np.savez(tmp_path / f"n{cid}.npz", x=_blobs(n, cid)[0], y=_blobs(n, cid)[1])
    sizes, batches = [], []
    for cid in range(2):
        ctx = Context(run_id=0, node_id=cid, node_config=_node(tmp_path / f"n{cid}.npz", cid=cid, n=2),
                      state=RecordDict(), run_config={**RUN, "batch-size-choices": "32"})
        setup = setup_client(ctx)
        sizes.append(len(setup.train) + len(setup.test))
        batches.append(setup.profile.batch_size)
    assert sizes == [25, 60] and batches == [20, 32]  # a drawn b_i of 32 is capped at node 0's N_i = 20
    ctx = Context(run_id=0, node_id=0, node_config=_node(tmp_path / "n0.npz", cid=0, n=2, **{"batch-size": 64}),
                  state=RecordDict(), run_config=RUN)
    with pytest.raises(NodeDataError, match=r"node-config 'batch-size' = 64 exceeds this node's N_i = 20"):
        setup_client(ctx)


@pytest.mark.parametrize(("run", "match"), [
    ({"input-shape": ""}, r"needs 'input-shape'"),
    ({"num-classes": 0}, r"needs 'num-classes'"),
    ({"input-shape": "[16, x]"}, r"'input-shape' = '\[16, x\]': expected a list of positive integers"),
    ({"model": "auto"}, r"has no default model"),
    ({"model": "cnn-mnist"}, r"'model' = 'cnn-mnist' does not fit run-config 'input-shape' = \[16\]"),
    ({"strategy": "fed-smp-topk"}, r"needs the server's public set"),
    ({"partitioner": "dirichlet"}, r"'partitioner' = 'dirichlet' would have no effect: dataset = 'node-local'"),
    ({"max-samples": 100}, r"'max-samples' = 100 would have no effect"),
    ({"dataset": "digits", "model": "auto"}, r"'input-shape' = '\[16\]' would have no effect"),
])
def test_the_run_config_schema_is_checked_before_anything_starts(run, match) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_config({**RUN, **run})


def test_the_launchers_take_input_shape_as_a_toml_array() -> None:
    from fedapp.run.processes import parse_overrides, to_toml_assignments

    values = parse_overrides("dataset='node-local' input-shape=[1,28,28] num-classes=10")  # no spaces: one token
    assert values["input-shape"] == "[1, 28, 28]"
    assert 'input-shape="[1, 28, 28]"' in to_toml_assignments(values)
    with pytest.raises(ConfigError, match="cannot parse --run-config"):
        parse_overrides("epsilon=[1, 2]")  # other keys stay scalars, as Flower's run-config holds them


def test_a_simulation_refuses_node_local_data() -> None:
    from fedapp.run.launch import checked_config

    with pytest.raises(ConfigError, match=r"'dataset' = 'node-local' trains each SuperNode on its own node-config "
                                          r"'data-path', which a simulation's nodes do not have"):
        checked_config(3, "dataset='node-local' input-shape=[16] num-classes=3 model='logreg'",
                       __import__("fedapp.run.processes", fromlist=["PROJECT_ROOT"]).PROJECT_ROOT)


def test_the_deploy_launcher_reads_every_node_file_and_names_the_node(tmp_path) -> None:
    from fedapp.run.deploy import node_configs, validate_nodes

    for cid in range(3):
        np.savez(tmp_path / f"n{cid}.npz", x=_blobs(30, cid, features=4 if cid == 2 else 16)[0], y=_blobs(30, cid)[1])
    cfg = resolve_config({**RUN, "num-clients": 3})
    nodes = node_configs(3, [f"{i}:data-path={tmp_path / f'n{i}.npz'}" for i in range(3)])
    with pytest.raises(ConfigError, match=r"SuperNode 2: node-config 'data-path' = .*n2\.npz'.*input-shape"):
        validate_nodes(cfg.general, cfg.training, cfg.data, nodes)
    validate_nodes(cfg.general, cfg.training, cfg.data, nodes[:2] + [{**nodes[2], "data-path": nodes[0]["data-path"]}])
    with pytest.raises(ConfigError, match=r"SuperNode 1: node-config 'data-path' is not set"):
        validate_nodes(cfg.general, cfg.training, cfg.data, [nodes[0], {"partition-id": 1, "num-partitions": 3}])
    digits = resolve_config({"num-clients": 3})
    with pytest.raises(ConfigError, match=r"SuperNode 0: node-config 'data-path' is read only with run-config "
                                          r"'dataset' = 'node-local'"):
        validate_nodes(digits.general, digits.training, digits.data, nodes)
