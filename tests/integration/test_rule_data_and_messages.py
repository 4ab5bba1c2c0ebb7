"""Issue #35, the data cases and the unclear messages. Two rules:
- "nothing is skipped without a count": a bad data record (a JSON line nested too deeply to read, a
  conversation the chat template refuses) is skipped and counted like any other; prepare stops only when none
  is left (`test_skipped_and_counted_*`);
- "one clear line": what stops a run says what is true, where, and the fix (`test_clear_line_*`); where the
  right result is possible (a vocab damaged after it was built, JSON lines in a .json file) it is the result.
Servers are real HTTP servers on 127.0.0.1 (tests/sglang_like_server.py: the true external boundary)."""

import json
import logging
import shutil
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_like_server import handler

from pipeline.data.mixture import load_conversations
from pipeline.errors import UserError
from pipeline.formats import vocab_map
from pipeline.runner import run_stages
from pipeline.serving import bench as online
from pipeline.serving import endpoint

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GOOD = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
SYSTEM = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}
NESTED = b"[" * 100_000  # Python's json reader gives up (RecursionError) long before
SPEC = {"model_path": "/models/t", "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}


def data_cfg(path, fmt="sharegpt", on_error="skip", split="train"):
    return SimpleNamespace(
        name=fmt,
        format=fmt,
        path=str(path),
        split=split,
        limit=None,
        seed=0,
        shuffle=False,
        on_error=on_error,
    )


def cli(*args, cache_dir):
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", *args, f"cache_dir={cache_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("eaglepipe: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return errors[0]


# ---- data records: skipped and counted


def test_skipped_and_counted_a_json_line_nested_too_deeply_to_read(tmp_path):
    good = json.dumps(GOOD).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join([good, NESTED, good]) + b"\n")
    convs, problems = load_conversations(data_cfg(path))
    assert len(convs) == 2 and problems.as_dict() == {"nested too deeply to read": 1}
    assert problems.where["nested too deeply to read"] == ["line 2"]
    with pytest.raises(UserError, match=r"d.jsonl line 2: nested too deeply to read"):
        load_conversations(data_cfg(path, on_error="fail"))
    # the same record inside a JSON list: skipped to its end, the records after it read
    listed = tmp_path / "d.json"
    listed.write_bytes(b"[" + good + b",\n" + NESTED + b"]" * 100_000 + b",\n" + good + b"]")
    convs, problems = load_conversations(data_cfg(listed))
    assert len(convs) == 2 and problems.as_dict() == {"nested too deeply to read": 1}
    assert problems.where["nested too deeply to read"][0].startswith("record 1")


@pytest.fixture
def refusing_target(tiny_folder, tmp_path):
    """The tiny target as a user's HF folder whose chat template refuses a system turn (Gemma's and Mistral's
    templates raise_exception on roles they do not take)."""
    folder = tmp_path / "target"
    shutil.copytree(tiny_folder, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    return folder


def test_skipped_and_counted_conversations_the_chat_template_refuses(
    refusing_target, make_cfg, tmp_path, caplog
):
    data = tmp_path / "chats.jsonl"
    good = {"messages": SYSTEM["messages"][1:]}
    data.write_text("\n".join(json.dumps(r) for r in (good, SYSTEM, good, SYSTEM, SYSTEM)) + "\n")
    over = ("+experiment=tiny", "target.source=path", f"target.path={refusing_target}", "data=messages")
    with caplog.at_level(logging.WARNING):
        run_stages(make_cfg(*over, f"data.path={data}", "stage=prepare", run_dir=tmp_path / "run"))
    stats = json.loads((tmp_path / "run/prepared/stats.json").read_text())
    reason = "the chat template refused it: System role not supported"
    assert stats["samples"] == 2 and stats["dropped_samples"] == {reason: 3}
    assert any(f"skipped 3 records of prepare: {reason}" in r.getMessage() for r in caplog.records)
    # none left: one line, not an empty prepared set
    data.write_text(json.dumps(SYSTEM) + "\n")
    with pytest.raises(UserError, match=rf"every conversation was dropped .*{reason}"):
        run_stages(make_cfg(*over, f"data.path={data}", "stage=prepare", run_dir=tmp_path / "run2"))


# ---- one clear line (or the right result)


@pytest.fixture(scope="module")
def parquets(tmp_path_factory):
    import datasets

    folder = tmp_path_factory.mktemp("parquet")
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    datasets.Dataset.from_dict({"messages": [turns] * 4}).to_parquet(str(folder / "chats.parquet"))
    datasets.Dataset.from_dict({"conversation": [turns] * 2, "text": ["x", "y"]}).to_parquet(
        str(folder / "other.parquet")
    )
    return folder


def test_clear_line_a_split_a_parquet_file_does_not_have(parquets):
    with pytest.raises(UserError, match=r"chats.parquet: no split 'test'; a parquet source has one split, "):
        load_conversations(data_cfg(parquets / "chats.parquet", "hf", split="test"))
    assert len(load_conversations(data_cfg(parquets / "chats.parquet", "hf", split="train[:50%]"))[0]) == 2


def test_clear_line_a_parquet_without_a_messages_column_names_its_columns(parquets):
    with pytest.raises(UserError) as e:
        load_conversations(data_cfg(parquets / "other.parquet", "hf"))
    assert "other.parquet has columns ['conversation', 'text']" in str(e.value)
    assert "a 'messages' column ([{role, content}]) or 'conversations'" in str(e.value)
    assert "empty conversation" not in str(e.value)


def test_clear_line_json_lines_in_a_json_file_are_read_as_json_lines(tmp_path, caplog):
    path = tmp_path / "x.json"
    path.write_bytes(b"\n".join([json.dumps(SYSTEM).encode(), b"{oops", json.dumps(SYSTEM).encode()]))
    with caplog.at_level(logging.INFO):
        convs, problems = load_conversations(data_cfg(path, "messages"))
    assert len(convs) == 2 and problems.where["malformed JSON"][0].startswith("line 2")
    assert any("holds JSON lines" in r.getMessage() for r in caplog.records)
    path.write_text('{"messages":\n [1]}')  # one object over several lines: neither a list nor JSON lines
    with pytest.raises(UserError, match=r"x.json: expected a JSON list of conversations .*\.jsonl"):
        load_conversations(data_cfg(path, "messages"))


def test_clear_line_data_limit_too_small_to_hold_out_says_so_not_val_fraction_0(make_cfg, tmp_path):
    from pipeline.acceptance.prompts import heldout_prompts
    from pipeline.formats import train_summary

    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as e:  # refused before the first stage
        run_stages(make_cfg("+experiment=tiny", "data.limit=1", run_dir=run_dir))
    assert "data.limit=1: 1 sample x train.val_fraction=0.15 holds none out" in str(e.value)
    assert "raise data.limit" in str(e.value) and "val_fraction=0 " not in str(e.value)
    assert not (run_dir / "prepared").exists()
    # a draft trained so (stage by stage): evaluate says the same
    cfg = make_cfg("+experiment=tiny", "data.limit=1", "stage=evaluate", run_dir=run_dir)
    final = run_dir / "train/final"
    final.mkdir(parents=True)
    train_summary.write(
        final,
        {
            "val_samples": [],
            "train_samples": 1,
            "tau_probe_half": "selection",
            "config": {"train": {"val_fraction": 0.15}},
        },
    )
    with pytest.raises(UserError) as e:
        heldout_prompts(cfg, None, 3, 512)
    assert "1 training sample x train.val_fraction=0.15 held none out" in str(e.value)
    assert "raise data.limit" in str(e.value) and "val_fraction=0)" not in str(e.value)


@pytest.fixture(scope="module")
def vocab_run(make_cfg, tmp_path_factory):
    """prepare and vocab on the tiny target (online features: vocab counts prepared/'s tokens)."""
    run_dir = tmp_path_factory.mktemp("vocab_run")
    for stage in ("prepare", "vocab"):
        run_stages(make_cfg(*VOCAB_RUN, f"stage={stage}", run_dir=run_dir))
    return run_dir


VOCAB_RUN = ("+experiment=tiny", "data.limit=16", "train.features=online")


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_clear_line_stage_vocab_rebuilds_its_damaged_output(vocab_run, make_cfg, tmp_path, caplog, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(vocab_run, run_dir)
    weights = run_dir / "vocab/vocab.safetensors"
    good = weights.read_bytes()
    weights.unlink() if damage == "removed" else weights.write_bytes(good[:100])
    with caplog.at_level(logging.INFO):
        run_stages(make_cfg(*VOCAB_RUN, "stage=vocab", run_dir=run_dir))
    assert not any("up to date" in r.getMessage() for r in caplog.records)
    assert weights.read_bytes() == good
    vocab_map.load(run_dir / "vocab")


def test_clear_line_multirun_over_a_finished_run_says_why_the_job_finds_nothing(
    vocab_run, tmp_path, cache_dir
):
    run_dir = tmp_path / "run"
    shutil.copytree(vocab_run, run_dir)
    line = cli(
        "-m", "stage=train", *VOCAB_RUN, "train.lr=1e-3,2e-3", f"run_dir={run_dir}", cache_dir=cache_dir
    )
    assert f"multirun job 0 runs stage=train in its own run dir {run_dir}/0" in line, line
    assert f"does not read the stages finished in {run_dir}" in line and "stage=all" in line, line
    assert "run stage=prepare first" not in line and "run stage=extract first" not in line


@pytest.fixture
def serve():
    servers = []

    def start(info, **kw):
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler(info, **kw))
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


def online_cfg(url):
    return SimpleNamespace(
        eval=SimpleNamespace(
            endpoint=url,
            baseline_endpoint=None,
            max_new_tokens=8,
            concurrency=[1],
            repeats=1,
            warmup_prompts=0,
            endpoint_timeout_s=10,
        )
    )


@pytest.mark.parametrize("answer", [b"{}", b'{"choices": []}', b'{"text": "x"}'])
def test_clear_line_a_server_answering_json_without_a_completion_is_named(serve, tmp_path, answer):
    url = serve(SPEC, generate_raw=answer)
    with pytest.raises(UserError) as e:
        online.measure(online_cfg(url), None, [[1, 2], [3]], tmp_path)
    line = str(e.value)
    assert f"the speculative server {url} gave an answer that is not a completion" in line, line
    assert f"POST /generate answered {answer.decode()!r}" in line and "EAGLE3" not in line, line
    assert "\n" not in line
    with pytest.raises(UserError, match=r"POST /v1/completions answered '\{\"choices\": \[\]\}'"):
        endpoint.generate_one(
            __import__("httpx").Client(), serve(SPEC, generate_raw=b'{"choices": []}'), "vllm", "m", [1], 4
        )


def test_clear_line_a_server_answering_completions_of_no_token_says_so(serve, tmp_path):
    url = serve(SPEC, generate_raw=b'{"text": "", "meta_info": {"completion_tokens": 0}}')
    with pytest.raises(UserError, match=rf"server {url} answered 2 prompts x 1 passes with 0 completion"):
        online.measure(online_cfg(url), None, [[1, 2], [3]], tmp_path)


def test_clear_line_an_endpoint_answering_bytes_that_are_not_utf8(serve, tmp_path):
    from pipeline.tools.doctor import read_server

    garbage = b"\xff\xfe\x00 not text \x80"
    url = serve(SPEC, generate_raw=garbage)
    with pytest.raises(UserError) as e:
        online.measure(online_cfg(url), None, [[1, 2]], tmp_path)
    assert f"{url} gave an answer that is not a completion" in str(e.value)
    assert "POST /generate answered bytes that are not UTF-8" in str(e.value) and "\n" not in str(e.value)
    url = serve(SPEC, info_raw=garbage)
    with pytest.raises(UserError, match=rf"{url}: GET /server_info answered bytes that are not UTF-8"):
        read_server(url)
    with pytest.raises(UserError, match=rf"{url}: GET /get_server_info answered bytes that are not UTF-8"):
        online.measure(online_cfg(url), None, [[1, 2]], tmp_path)
