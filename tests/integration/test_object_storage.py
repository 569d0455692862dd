"""The LanceDB buffer on S3-compatible object storage (``buffer.uri=s3://...``), against a real
S3 server on loopback: moto's ``moto_server`` (``pip install "moto[server]"``), started as a
subprocess by the fixture below, with a bucket made through boto3. No mock of our components
or of Lance: every read, append, commit and tag below is an HTTP request to that server.

What is shown here (infra/object-storage.md has the background):

* the stores' operations work on s3 (create, append, window, take_seqs, read by policy
  version, tag, read_at, compact, usage records), and the objects are in the bucket;
* Lance commits each version with a conditional PUT of its manifest (``If-None-Match: *``,
  read from the server's request recording), and the server refuses a second conditional PUT
  of the same key: the mechanism that makes concurrent commits safe on S3;
* two writer processes appending to one s3 table keep every row, without duplicates, and a
  read by policy version returns exactly the expected rows;
* a training run (flows.train.train), its resume and ``flows.query`` work with the buffer on s3;
* a missing bucket, a wrong endpoint or a plain-http endpoint without allow_http fail before
  any work, saying what to set.

moto checks ``If-None-Match`` and then writes, without a lock around the two (it is a
threaded test server), so it is a faithful S3 for Lance's commit protocol but not a proof of
the server-side atomicity that AWS S3, MinIO or R2 provide.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import sys
import uuid
from pathlib import Path

import pytest

try:
    import boto3
    import moto.server  # noqa: F401  (the server runs in a subprocess; fail here if it is missing)
except ImportError as exc:  # pragma: no cover - an environment problem, reported as such
    raise ImportError(f"{exc}: these tests need an S3 server on loopback: "
                      "pip install -c infra/constraints-cpu.txt 'moto[server]'") from exc

from replay_pipeline.buffer import RolloutStore, StoreError
from replay_pipeline.buffer.usage import UsageStore, make_usage_id
from replay_pipeline.config import ConfigError, load_config
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_store import RUN, make_rows
from tests.servers import LOOPBACK, free_port, start_process, stop_process, wait_for_http

REGION = "us-east-1"
KEY_ID, SECRET = "test-key-id", "test-secret-do-not-log"


class S3Server:
    """A moto server on loopback: its endpoint, Lance storage options, boto3 client, log."""

    def __init__(self, endpoint: str, proc, log: Path, recording: Path):
        self.endpoint, self.proc, self.log, self.recording = endpoint, proc, log, recording
        self.options = {"aws_endpoint": endpoint, "allow_http": "true", "aws_region": REGION,
                        "aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET}
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION,
                                   aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)

    def new_bucket(self) -> str:
        name = f"rp-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def record(self, on: bool) -> None:
        """Start (after clearing it) or stop the server's request recording (moto's recorder:
        method, URL and headers of every request, one JSON line each)."""
        import urllib.request

        for action in (["reset-recording", "start-recording"] if on else ["stop-recording"]):
            urllib.request.urlopen(urllib.request.Request(
                f"{self.endpoint}/moto-api/recorder/{action}", method="POST"), timeout=10).read()

    def recorded(self) -> list[dict]:
        return [json.loads(line) for line in self.recording.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on a free loopback port, for this module; stopped by process id."""
    work = tmp_path_factory.mktemp("s3-server")
    port = free_port()
    recording = work / "recording.jsonl"
    proc = start_process([sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)],
                         work / "moto.log", env={"MOTO_RECORDER_FILEPATH": str(recording)})
    try:
        endpoint = f"http://{LOOPBACK}:{port}"
        wait_for_http(endpoint + "/moto-api/", timeout=60, proc=proc)
        yield S3Server(endpoint, proc, work / "moto.log", recording)
    finally:
        stop_process(proc)


def hydra_options(s3: S3Server) -> str:
    """The storage options as a Hydra override of the declared field."""
    return ("buffer.storage_options={aws_endpoint:'%s',allow_http:true,aws_region:%s,"
            "aws_access_key_id:%s,aws_secret_access_key:%s}" % (s3.endpoint, REGION, KEY_ID, SECRET))


def usage_rows(learner_step: int, seqs: list[int], rollouts) -> list[dict]:
    import datetime as dt

    by_seq = {r["seq"]: r for r in rollouts}
    return [dict(usage_id=make_usage_id(RUN, learner_step, i), run_id=RUN, learner_step=learner_step,
                 step=learner_step, position=i, rollout_id=by_seq[q]["rollout_id"], rollout_seq=q,
                 rollout_step=by_seq[q]["step"], rollout_policy_version=by_seq[q]["policy_version"],
                 policy_version=learner_step + 1, staleness=learner_step + 1 - by_seq[q]["policy_version"],
                 created_at=dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc))
            for i, q in enumerate(seqs)]


# ------------------------------------------------------------------ the stores on s3
def test_store_operations_on_s3(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a local database made by mistake would appear here
    bucket = s3.new_bucket()
    uri = f"s3://{bucket}/replay/lancedb"
    store = RolloutStore.create(uri, RUN, storage_options=s3.options)
    usage = UsageStore.create(uri, RUN, storage_options=s3.options)
    for step in range(4):
        assert store.append(make_rows(step, policy_version=step // 2)) == 8
    assert store.append(make_rows(3)) == 0  # a retried batch adds nothing
    assert store.count() == 32
    assert store.window(12, ["seq"]).column("seq").to_pylist() == list(range(20, 32))
    took = store.take_seqs([31, 0, 31], ["seq", "rollout_id"])
    assert took.column("seq").to_pylist() == [31, 0, 31]
    assert took.column("rollout_id")[1].as_py() == make_rows(0)[0]["rollout_id"]
    # read by policy version: steps 2 and 3 were generated by version 1
    by_version = store.rows_for_versions(1, 1, ["rollout_id", "policy_version", "seq"])
    assert by_version.column("rollout_id").to_pylist() == [r["rollout_id"] for s in (2, 3) for r in make_rows(s)]
    assert set(by_version.column("policy_version").to_pylist()) == {1}

    store.tag("step-000004")
    rows = store.window(32).to_pylist()
    assert usage.record(usage_rows(0, [30, 31, 31], rows)) == 3
    assert usage.reuse_counts(0) == {30: 1, 31: 2}
    usage.tag("step-000004")
    store.append(make_rows(4, policy_version=2))
    assert store.read_at("step-000004", ["seq"]).num_rows == 32 and store.count() == 40
    store.compact()
    assert store.count() == 40 and set(store.tags()) == {"step-000004"}
    assert store.read_at("step-000004").num_rows == 32  # a tagged version survives compaction
    assert {tuple(ix.columns) for ix in store.table.list_indices()} >= {("rollout_id",), ("seq",), ("policy_version",)}

    # A fork: a shallow clone at the tag, in the same bucket; the source is left alone.
    fork = RolloutStore.fork(uri, RUN, "step-000004", "fork-a", storage_options=s3.options)
    assert fork.count() == 32 and fork.append(make_rows(9, run_id="fork-a")) == 8 and store.count() == 40

    again = RolloutStore.open(uri, RUN, storage_options=s3.options)  # a second handle, e.g. a resume
    assert again.count() == 40 and again.append(make_rows(4)) == 0
    assert RolloutStore.list_runs(uri, storage_options=s3.options) == ["fork-a", RUN]
    keys = s3.keys(bucket, "replay/lancedb/")
    assert any(k.startswith(f"replay/lancedb/rollouts_{RUN}.lance/_versions/") for k in keys)
    assert any(k.startswith(f"replay/lancedb/usage_{RUN}.lance/data/") for k in keys)
    assert list(tmp_path.iterdir()) == []  # nothing was written locally


def test_commits_are_conditional_puts_the_server_enforces(s3):
    bucket = s3.new_bucket()
    # The server refuses a second conditional PUT of an existing key ...
    s3.client.put_object(Bucket=bucket, Key="probe", Body=b"1", IfNoneMatch="*")
    with pytest.raises(s3.client.exceptions.ClientError, match="PreconditionFailed"):
        s3.client.put_object(Bucket=bucket, Key="probe", Body=b"2", IfNoneMatch="*")
    assert s3.client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"1"
    # ... and Lance writes every version's manifest (and every tag) with such a PUT.
    store = RolloutStore.create(f"s3://{bucket}/db", RUN, storage_options=s3.options)
    s3.record(True)
    try:
        for step in range(3):
            store.append(make_rows(step))
        store.tag("step-000003")
    finally:
        s3.record(False)
    puts = [r for r in s3.recorded() if r["method"] == "PUT"]
    manifests = [r for r in puts if re.search(r"/_versions/\d+\.manifest$", r["url"])]
    tags = [r for r in puts if "/_refs/tags/" in r["url"]]
    assert len(manifests) == 3 and len(tags) == 1, [r["url"] for r in puts]
    for r in manifests + tags:
        headers = {k.lower(): v for k, v in r["headers"].items()}
        assert headers.get("if-none-match") == "*", r["url"]


# ------------------------------------------------------------------ concurrent writers
def _append_steps(uri: str, options: dict, first_step: int, steps: int) -> None:
    writer = RolloutStore.open(uri, RUN, storage_options=options)
    for step in range(first_step, first_step + steps):
        writer.append(make_rows(step, policy_version=step % 100))


def test_two_writer_processes_keep_every_row_on_s3(s3):
    bucket = s3.new_bucket()
    uri = f"s3://{bucket}/db"
    store = RolloutStore.create(uri, RUN, storage_options=s3.options)
    conflicts_before = s3.log.read_text().count(".manifest HTTP/1.1\" 412")
    ctx = mp.get_context("spawn")  # fork hangs LanceDB
    firsts, steps = (0, 100), 15
    procs = [ctx.Process(target=_append_steps, args=(uri, s3.options, first, steps)) for first in firsts]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    batches = {s: make_rows(s, policy_version=s % 100) for first in firsts for s in range(first, first + steps)}
    assert store.count() == 2 * steps * 8
    ids = store.table.search().select(["rollout_id"]).limit(None).to_arrow().column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)) == 2 * steps * 8
    assert set(ids) == {r["rollout_id"] for rows in batches.values() for r in rows}
    # Read by policy version: versions 3..4 are steps 3, 4, 103 and 104, from both writers.
    got = store.rows_for_versions(3, 4, ["rollout_id", "policy_version", "step"])
    expected = sorted(r["rollout_id"] for s in (3, 4, 103, 104) for r in batches[s])
    assert sorted(got.column("rollout_id").to_pylist()) == expected
    assert set(got.column("policy_version").to_pylist()) == {3, 4}
    assert store.append(batches[0] + batches[114]) == 0  # both writers' rows are found
    # Commits that raced for the same version number: refused by the server (412) and retried
    # by Lance on the next version. How many varies from run to run (often a few, maybe 0).
    conflicts = s3.log.read_text().count(".manifest HTTP/1.1\" 412") - conflicts_before
    print(f"manifest PUTs refused with 412 and retried: {conflicts}")


# ------------------------------------------------------------------ a training run on s3
def test_training_run_resume_and_query_with_the_buffer_on_s3(s3, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from flows.query import main as query
    from flows.train import train

    bucket = s3.new_bucket()
    uri = f"s3://{bucket}/runs/lancedb"
    root = tmp_path / "runs"
    run_id = "s3run"
    summary = train([f"tracking.root_dir={root}", *TINY_OVERRIDES, f"run_id={run_id}", "loop.steps=2",
                     "loop.eval_every=0", "loop.passk_every=0", f"buffer.uri={uri}", hydra_options(s3),
                     "model.warmstart.target_accuracy=0"])  # the buffer is under test, not learning
    rollouts = 4 * 4  # TINY_OVERRIDES: 4 prompts x 4 completions per step
    assert summary["status"] == "FINISHED" and summary["lancedb_uri"] == uri
    store = RolloutStore.open(uri, run_id, storage_options=s3.options)
    assert store.count() == 2 * rollouts
    assert sorted(set(store.window(100, ["policy_version"]).column("policy_version").to_pylist())) == [0, 1]
    usage = UsageStore.open(uri, run_id, storage_options=s3.options)
    assert usage.count() > 0
    assert not (root / "lancedb").exists()  # the buffer is on s3 only
    assert any(k.startswith(f"runs/lancedb/rollouts_{run_id}.lance/") for k in s3.keys(bucket))

    # The secret is not in MLflow (params, config artifact); the endpoint is.
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    mlflow_run = client.search_runs([client.get_experiment_by_name("replay-pipeline").experiment_id])[0]
    params = mlflow_run.data.params
    assert params["buffer.storage_options.aws_secret_access_key"] == "***"
    assert params["buffer.storage_options.aws_endpoint"] == s3.endpoint
    config = Path(client.download_artifacts(mlflow_run.info.run_id, "config.yaml", str(tmp_path / "dl")))
    assert SECRET not in config.read_text() and s3.endpoint in config.read_text()

    # flows.query reads them back by policy version, with the run's storage options.
    out = tmp_path / "v1.jsonl"
    argv = ["rollouts", run_id, "--uri", uri, "--versions", "1:1", "--format", "jsonl", "--output", str(out)]
    argv += [f"--storage-option={k}={v}" for k, v in s3.options.items()]
    assert query(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == rollouts and {r["policy_version"] for r in rows} == {1}
    assert sorted(r["rollout_id"] for r in rows) == sorted(store.rows_for_versions(1, 1, ["rollout_id"])
                                                          .column("rollout_id").to_pylist())

    # Resume from the step-2 checkpoint into the same s3 tables (config from the saved run):
    # the CLI's start-point check opens the s3 tables (--cfg stops after it), then the flow.
    from flows.train import main as train_main

    assert train_main([f"tracking.root_dir={root}", f"resume={run_id}", "loop.steps=3", "--cfg"]) == 0
    assert f"uri: {uri}" in capsys.readouterr().out
    resumed = train([f"tracking.root_dir={root}", f"resume={run_id}", "loop.steps=3"])
    assert resumed["status"] == "FINISHED" and resumed["mlflow_run_id"] == mlflow_run.info.run_id
    assert store.count() == 3 * rollouts
    assert store.rows_for_versions(2, 2, ["seq"]).num_rows == rollouts
    assert not (root / "lancedb").exists()


# ------------------------------------------------------------------ bad input
def test_training_cli_refuses_a_missing_bucket_before_any_work(s3, tmp_path, capsys):
    from flows.train import main as train_main

    root = tmp_path / "runs"
    argv = [f"tracking.root_dir={root}", *TINY_OVERRIDES, "run_id=never", "buffer.uri=s3://no-such-bucket/db",
            hydra_options(s3)]
    assert train_main(argv) == 2  # before Prefect, MLflow or any model
    err = capsys.readouterr().err
    assert "the bucket 'no-such-bucket' does not exist" in err and f"--endpoint-url {s3.endpoint}" in err
    assert "aws_endpoint / AWS_ENDPOINT_URL" in err  # and what to set in general
    assert not (root / "never").exists() and not (root / "mlflow.db").exists()


def test_unreachable_store_errors_say_what_to_set(s3, capsys, tmp_path):
    from replay_pipeline.run.preflight import preflight

    bucket = s3.new_bucket()
    base = [*TINY_OVERRIDES, f"buffer.uri=s3://{bucket}/db", f"tracking.root_dir={tmp_path}"]
    # Nothing listens at the endpoint: refused by the pre-flight, before any work.
    dead = f"http://{LOOPBACK}:{free_port()}"
    with pytest.raises(ConfigError, match=f"nothing answered at endpoint {dead}.*aws_endpoint / AWS_ENDPOINT_URL"):
        preflight(load_config([*base, hydra_options(s3).replace(s3.endpoint, dead)]))
    # Lance's DynamoDB commit store would be bypassed by the buffer's appends: refused, offline.
    with pytest.raises(ConfigError, match=r"s3\+ddb://\) is not supported"):
        load_config([*TINY_OVERRIDES, f"buffer.uri='s3+ddb://{bucket}/db?ddbTableName=t'"])
    # A plain-http endpoint needs allow_http: the store says so to a library user.
    no_http = {k: v for k, v in s3.options.items() if k != "allow_http"}
    with pytest.raises(StoreError, match="is plain http.*set allow_http=true"):
        RolloutStore.create(f"s3://{bucket}/db", RUN, storage_options=no_http)
    # The query CLI: a missing bucket, exit status 2 and the same advice.
    from flows.query import main as query

    argv = ["runs", "--uri", "s3://no-such-bucket/db", *[f"--storage-option={k}={v}" for k, v in s3.options.items()]]
    assert query(argv) == 2
    assert "the bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
    assert s3.keys(bucket) == []  # nothing was created


def test_storage_options_config_is_checked_without_a_server():
    with pytest.raises(ConfigError, match="buffer.storage_options is set but buffer.uri is unset"):
        load_config(["buffer.storage_options.aws_region=us-east-1"])  # per-key syntax, no `+`
    with pytest.raises(ConfigError, match="buffer.storage_options.nested must be a string"):
        load_config(["buffer.uri=s3://bucket/db", "buffer.storage_options={nested:{a:1}}"])
    with pytest.raises(ConfigError, match="buffer.storage_optionz"):  # other keys stay strict
        load_config(["buffer.storage_optionz={a:1}"])


def test_secrets_are_masked_for_mlflow():
    from replay_pipeline.tracking.tracker import mask_secrets, mask_secrets_text

    params = {"buffer.storage_options.aws_secret_access_key": "s", "buffer.storage_options.aws_session_token": "t",
              "buffer.storage_options.aws_endpoint": "http://h:9000", "generator.max_new_tokens": 6,
              "buffer.storage_options.azure_storage_account_key": "k"}
    assert mask_secrets(params) == {**params, "buffer.storage_options.aws_secret_access_key": "***",
                                    "buffer.storage_options.aws_session_token": "***",
                                    "buffer.storage_options.azure_storage_account_key": "***"}
    text = "buffer:\n  storage_options:\n    aws_secret_access_key: s3cr3t\n    aws_endpoint: http://h:9000\n"
    assert mask_secrets_text(text) == text.replace("s3cr3t", "'***'")
    as_json = json.dumps({"aws_secret_access_key": 12345, "max_new_tokens": 6}, indent=2)
    assert json.loads(mask_secrets_text(as_json)) == {"aws_secret_access_key": "***", "max_new_tokens": 6}
