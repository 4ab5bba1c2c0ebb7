"""Serve an eaglepipe export in a REAL SGLang server and record what SGLang itself does (issue #10, item 4 and 6).

For the good export, the good export launched with EAGLE instead of EAGLE3, and each seed-failure mutation of
tests/mutations.py: the engine-free eaglepipe checks (pipeline.tools.verify.check_export, pipeline.tools.doctor.diagnose
on the launch line) BEFORE serving, then the server itself: did it start, the lines of its log that mention
errors/warnings/weights/keys/aux, and the accept length over the held-out eval prompts (greedy, /generate:
completion_tokens / meta_info.spec_verify_ct), and whether its greedy output equals the plain server's.

Runs on the GPU box (no SGLang import here: servers are subprocesses with their own PYTHONPATH):
  python3 scripts/bench/sglang_serving.py --run-dir /tmp/gpurun --work /tmp/sglserve --budget 540 CASE...
Cases run in order; one already recorded in WORK/CASE.json is skipped, so calls can resume. A case never
started past the budget. `baseline` starts the no-speculation server and LEAVES it running (its process group
id in WORK/baseline.pgid); `stop-baseline` stops it. `good` also runs `eaglepipe evaluate eval.endpoint=...`
(concurrency 1 and 8, beside the baseline) and `eaglepipe doctor server=...`; `eagle` runs doctor too.
WORK/sglang_serving.json gathers every case. Speculative servers run with --disable-cuda-graph unless
--cuda-graph: SGLang 0.5.17's draft CUDA-graph capture imports deep_gemm, which the H200 bundle does not carry.
While each server starts, pipeline.engines.sglang_verify loads the same folder into the box's own SGLang class on
CPU (`engine_check`). scripts/bench/sglang_serving.sh drives the chain and the calls; the run of 2026-12-01 is in
scripts/bench/results/sglang_serving_2026-12-01.json (BENCHMARKS.md has the table).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SPEC_PORT, BASE_PORT, GRAPH_PORT = 30000, 30001, 30002
MUTATIONS = ["prefix_keys", "pre_rename_keys", "no_aux_ids", "absolute_d2t", "zero_fc", "single_layer_fc"]
NOTEWORTHY = re.compile(r"error|warn|exception|traceback|missing|unexpected|not found|skip|ignor|weight|"
                        r"aux|eagle|hot_token|d2t|draft|shape|mismatch|nan|assert", re.I)
NOISE = re.compile(r"GET /health|POST /generate|/server_info|/get_server_info|/v1/models|Decode batch|"
                   r"Prefill batch|capture cuda graph|Capture cuda graph|it/s\]|s/it\]", re.I)


def sgl_env() -> dict:
    """Processes that import SGLang: the bundle's site first (its transformers 5.12.1), then ours."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(p for p in ["/tmp/sgl-site", "/tmp/site", str(ROOT)] if p)
    bindir = Path("/tmp/pybin")  # serve.sh says `python`; the image may only have python3
    if not shutil.which("python"):
        bindir.mkdir(exist_ok=True)
        if not (bindir / "python").exists():
            (bindir / "python").symlink_to(shutil.which("python3"))
        env["PATH"] = f"{bindir}:{env['PATH']}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def start_server(line: str, log: Path, port: int, timeout_s: float) -> dict:
    """`bash -c LINE` in its own session (process group id = pid); waits for /health or the process' end."""
    import httpx

    fh = open(log, "w")
    t0 = time.time()
    proc = subprocess.Popen(["bash", "-c", line], stdout=fh, stderr=subprocess.STDOUT, env=sgl_env(),
                            start_new_session=True, cwd=ROOT)
    info = {"launch": line, "pgid": proc.pid, "started": False}
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            info.update(exit_code=proc.returncode)
            break
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                info["started"] = True
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    else:
        info["timed_out"] = True
    info["start_s"] = round(time.time() - t0, 1)
    info["proc"] = proc
    return info


def stop_server(pgid: int, proc=None) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(40):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    time.sleep(3)  # let the GPU memory go back before the next server sizes its KV cache


def log_lines(log: Path, limit: int = 60) -> list[str]:
    if not log.exists():
        return []
    out = []
    for ln in log.read_text(errors="replace").splitlines():
        if NOTEWORTHY.search(ln) and not NOISE.search(ln):
            ln = ln.strip()
            if ln and ln not in out:
                out.append(ln[:400])
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def generate(url: str, prompts: list[list[int]], max_new: int, concurrency: int = 8) -> dict:
    """Greedy /generate over the prompts: outputs, pooled accept length, the server's own counters."""
    import httpx

    def one(p):
        r = client.post(url + "/generate", json={"input_ids": p, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0.0}})
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
        b = r.json()
        m = b.get("meta_info") or {}
        return {"output_ids": b.get("output_ids"), "completion_tokens": int(m.get("completion_tokens", 0)),
                "verify_ct": int(m.get("spec_verify_ct") or 0), "spec_accept_length": m.get("spec_accept_length"),
                "spec_accept_histogram": m.get("spec_accept_histogram")}

    t0 = time.perf_counter()
    with httpx.Client(timeout=90) as client, ThreadPoolExecutor(concurrency) as pool:
        try:
            res = list(pool.map(one, prompts))
        except httpx.HTTPError as e:
            return {"error": f"{type(e).__name__}: {e}"}
    wall = time.perf_counter() - t0
    ok = [r for r in res if "error" not in r]
    toks, ver = sum(r["completion_tokens"] for r in ok), sum(r["verify_ct"] for r in ok)
    hist = None
    for r in ok:
        h = r.get("spec_accept_histogram")
        if isinstance(h, list):
            hist = [a + b for a, b in zip(hist, h)] if hist and len(hist) == len(h) else (hist or list(h))
    return {"requests": len(res), "errors": [r["error"] for r in res if "error" in r][:5], "completion_tokens": toks,
            "verify_passes": ver, "wall_s": round(wall, 2),
            "accept_length": toks / ver if ver else None,
            # offline tau counts target forwards after the prefill: the prefill's token is not a verify pass
            "accept_length_excl_prefill_token": (toks - len(ok)) / ver if ver else None,
            "spec_accept_histogram_sum": hist,
            "outputs": [r.get("output_ids") for r in res]}


def compare(outputs: list, reference: list) -> dict:
    """Greedy equality against the no-speculation server: prompts equal, and where they first differ."""
    equal, first = 0, []
    for i, (a, b) in enumerate(zip(outputs, reference)):
        if a is None or b is None:
            continue
        if a == b:
            equal += 1
        else:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first.append({"prompt": i, "first_diff": pos, "len_spec": len(a), "len_plain": len(b)})
    return {"equal": equal, "compared": min(len(outputs), len(reference)), "differing": first}


def cpu_checks(folder: Path, line: str) -> dict:
    """What eaglepipe says before anything is served: check_export (engine-free) and doctor on the line."""
    from pipeline.tools.doctor import diagnose
    from pipeline.tools.verify import check_export, read_export

    _, facts = read_export(folder)
    try:
        ce = check_export(folder, "sglang", facts)
    except Exception as e:  # noqa: BLE001 - a crash is a finding too
        ce = [f"check_export raised {type(e).__name__}: {e}"]
    try:
        dg = diagnose(folder, line)
    except Exception as e:  # noqa: BLE001
        dg = [f"doctor raised {type(e).__name__}: {e}"]
    return {"check_export": ce, "doctor_launch_line": dg}


def engine_check(folder: Path, target: str, algorithm: str, want_ids: list[int]) -> dict:
    """pipeline.engines.sglang_verify under THIS box's SGLang (the bundle's): its own class and loader, on CPU."""
    from pipeline.tools.verify import engine_problems

    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "pipeline.engines.sglang_verify", str(folder), target, algorithm],
                           capture_output=True, text=True, env=sgl_env(), cwd=ROOT, timeout=150)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 150 s"}
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-3:] if r.stderr.strip() else f"rc {r.returncode}",
                "seconds": round(time.time() - t0, 1)}
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    return {"engine_version": rep.get("engine_version"), "problems": engine_problems(rep, want_ids),
            "seconds": round(time.time() - t0, 1)}


def mutate(good: Path, name: str, dst: Path) -> Path:
    import mutations as m

    if dst.exists():
        shutil.rmtree(dst)
    edits = {"prefix_keys": dict(tensors=lambda t: m.prefix_keys(t, "draft_model.")),
             "pre_rename_keys": dict(tensors=m.pre_rename_keys),
             "no_aux_ids": dict(config=lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")),
             "absolute_d2t": dict(tensors=m.absolute_d2t), "zero_fc": dict(tensors=m.zero_fc),
             "single_layer_fc": dict(tensors=m.single_layer_fc)}[name]
    return m.mutated_copy(good, dst, **edits)


def eaglepipe(args: list[str], log: Path, timeout: int = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=f"/tmp/site:{ROOT}")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=timeout)
    log.write_text(r.stdout + r.stderr)
    tail = (r.stdout + r.stderr).strip().splitlines()
    return {"argv": args, "rc": r.returncode, "seconds": round(time.time() - t0, 1),
            "tail": [t for t in tail if "doctor" in t or "error" in t.lower() or "online" in t][-12:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--run-dir", default="/tmp/gpurun")
    ap.add_argument("--work", default="/tmp/sglserve")
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--case-s", type=float, default=150, help="no case starts with less than this left")
    ap.add_argument("--overrides", default="+experiment=gpu_smollm2 target.path=/tmp/model/smol.gguf "
                    "cache_dir=/tmp/epcache export.verify_in_engine=false train.wandb.mode=disabled eval.max_draft=3 "
                    "export.serve.sglang_args=[--attention-backend,triton]")
    ap.add_argument("--cuda-graph", action="store_true", help="leave CUDA graphs on (speculative servers)")
    ap.add_argument("--no-engine-check", action="store_true")
    ap.add_argument("--mem", default="0.5", help="--mem-fraction-static of speculative servers")
    ap.add_argument("--base-mem", default="0.2", help="--mem-fraction-static of the no-speculation server")
    ap.add_argument("--target", default=None, help="target HF folder (default: the store manifest's)")
    ap.add_argument("--tag", default="", help="suffix of each case's record and log (two drafts, one work dir)")
    ap.add_argument("--eval-conc", default="1,8", help="client concurrencies of the good case's online evaluate")
    ap.add_argument("--served-name", default="smollm2-135m-instruct",
                    help="the baseline's model name (prepare.regenerate_endpoint sends the target's name)")
    a = ap.parse_args()
    t_start = time.time()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    run_dir = Path(a.run_dir)
    good = run_dir / "export" / "sglang"
    ov = shlex.split(a.overrides) + [f"run_dir={run_dir}"]
    prompts_file = work / "prompts.json"
    store_manifest = run_dir / "features" / "manifest.json"
    spec_url, base_url = f"http://127.0.0.1:{SPEC_PORT}", f"http://127.0.0.1:{BASE_PORT}"

    missing = missing_serve_args(good, ov)
    if missing:  # 2026-12-02: an export made without the bundle's --attention-backend triton failed on FA3 mid-plan
        sys.exit(f"sglang_serving: {good / 'serve.sh'} lacks {' '.join(missing)} that the overrides' "
                 "export.serve.sglang_args ask for; run stage=export with the same overrides first")
    for case in a.cases:
        out = work / f"{case}{a.tag}.json"
        left = a.budget - (time.time() - t_start)
        if case == "stop-baseline":
            pg = work / "baseline.pgid"
            if pg.exists():
                stop_server(int(pg.read_text()))
                pg.unlink()
                print("baseline stopped", flush=True)
            continue
        if out.exists():
            print(f"{case}: recorded already, skipped", flush=True)
            continue
        if left < a.case_s:
            print(f"{case}: not started, {left:.0f} s of the budget left", flush=True)
            continue
        if not prompts_file.exists() and store_manifest.exists():
            write_prompts(prompts_file, ov, run_dir)
        P = json.loads(prompts_file.read_text()) if prompts_file.exists() else {"prompts": [], "max_new_tokens": 0}
        prompts, max_new = P["prompts"], P["max_new_tokens"]
        rec: dict = {"case": case, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        log = work / f"{case}{a.tag}.log"
        target = a.target or json.loads(store_manifest.read_text())["facts"]["target_path"]
        if case == "baseline_generate":  # the baseline came up before the store existed (it regenerated the data)
            rec = json.loads((work / "baseline.json").read_text())
            rec["generate"] = generate(base_url, prompts, max_new)
            (work / "baseline.json").write_text(json.dumps(rec, indent=1))
            out.write_text(json.dumps({"case": case, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}))
            continue
        if case == "baseline":
            line = (f"python -m sglang.launch_server --model-path {target} --dtype bfloat16 --attention-backend triton "
                    f"--port {BASE_PORT} --mem-fraction-static {a.base_mem} --served-model-name {a.served_name}")
            if not a.cuda_graph:  # like for like with the speculative servers, which cannot capture graphs here
                line += " --disable-cuda-graph"
            # 2026-12-01: with CUDA graphs on and training beside it, this server was still capturing at 150 s
            info = start_server(line, log, BASE_PORT, max(60, min(400, left - 30)))
            proc = info.pop("proc")
            rec["server"] = info
            if info["started"]:
                (work / "baseline.pgid").write_text(str(info["pgid"]))
                if prompts:
                    rec["generate"] = generate(base_url, prompts, max_new)
                rec["server_info_version"] = _server_version(base_url)
            else:
                stop_server(info["pgid"], proc)
            rec["log_lines"] = log_lines(log)
            out.write_text(json.dumps(rec, indent=1))
            _gather(work)
            continue
        if case == "baseline_cg":
            rec.update(graph_baseline(target, prompts, max_new, log, left))
            out.write_text(json.dumps(rec, indent=1))
            _gather(work)
            continue
        if case == "margins":
            rec.update(margins(base_url, prompts, work))
            out.write_text(json.dumps(rec, indent=1))
            _gather(work)
            continue
        if not (good / "serve.sh").exists():
            print(f"{case}: no export yet at {good}", flush=True)
            break
        serve_line = (good / "serve.sh").read_text().strip()
        folder = good
        if case in MUTATIONS:
            folder = mutate(good, case, work / "mut" / case / "sglang")
        line = serve_line.replace(str(good), str(folder))
        if case == "eagle":
            line = line.replace("--speculative-algorithm EAGLE3", "--speculative-algorithm EAGLE")
        rec["cpu_checks"] = cpu_checks(folder, line)
        deploy = f" --port {SPEC_PORT} --mem-fraction-static {a.mem}"
        if not a.cuda_graph:  # 0.5.17's draft CUDA-graph capture imports deep_gemm, which the bundle lacks
            deploy += " --disable-cuda-graph"
        pool = ThreadPoolExecutor(1)  # SGLang's own class on CPU while the server starts
        facts = json.loads(store_manifest.read_text())["facts"]
        from pipeline.formats.export_layouts import engine_layer_ids
        from pipeline.models.targets import architecture
        want = engine_layer_ids("sglang", [int(i) for i in facts["aux_layer_ids"]], architecture(Path(target)))
        fut = pool.submit(engine_check, folder, target, "EAGLE" if case == "eagle" else "EAGLE3", want) \
            if not a.no_engine_check else None
        info = start_server(line + deploy, log, SPEC_PORT, max(60, min(300, left - 30)))
        proc = info.pop("proc")
        if fut is not None:
            try:
                rec["engine_check"] = fut.result(timeout=120)
            except Exception as e:  # noqa: BLE001
                rec["engine_check"] = {"error": f"{type(e).__name__}: {e}"}
        pool.shutdown(wait=False)
        rec["server"] = info
        if info["started"]:
            g = generate(spec_url, prompts, max_new)
            base = work / "baseline.json"
            if base.exists() and "outputs" in g:
                ref = json.loads(base.read_text()).get("generate", {}).get("outputs") or []
                g["greedy_vs_plain_server"] = compare(g["outputs"], ref)
            rec["generate"] = g
            rec["server_info_version"] = _server_version(spec_url)
            if case in ("good", "eagle"):
                rec["doctor_server"] = eaglepipe(["stage=doctor", f"server={spec_url}", f"export_dir={good}", *ov],
                                                 work / f"{case}{a.tag}.doctor.log", 120)
            if case == "good":
                ev = []
                base_up = (work / "baseline.pgid").exists()  # online_bench drops both halves if the baseline is down
                for conc in [int(c) for c in a.eval_conc.split(",") if c not in ("", "none")]:
                    r = eaglepipe(["stage=evaluate", *ov, f"eval.endpoint={spec_url}",
                                   *([f"eval.baseline_endpoint={base_url}"] if base_up else []),
                                   f"eval.concurrency=[{conc}]"],
                                  work / f"good{a.tag}.evaluate_c{conc}.log", 300)
                    online = run_dir / "eval" / "online.json"
                    if online.exists():
                        r["online"] = json.loads(online.read_text())
                        shutil.copy(online, work / f"online_c{conc}{a.tag}.json")
                    sets = run_dir / "eval" / "sets_online.json"  # with eval.sets: the table over the prompt sets
                    if sets.exists():
                        r["sets_online"] = json.loads(sets.read_text())
                        shutil.copy(sets, work / f"online_sets_c{conc}{a.tag}.json")
                    ev.append(r)
                rec["evaluate_online"] = ev
        rec["log_lines"] = log_lines(log)
        if not info["started"]:
            rec["log_tail"] = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
        stop_server(info["pgid"], proc)
        out.write_text(json.dumps(rec, indent=1))
        _gather(work)
        print(f"{case}: started={info['started']} in {info['start_s']} s, accept length "
              f"{(rec.get('generate') or {}).get('accept_length')}", flush=True)
        if not info["started"]:  # why, in the plan's own log (2026-12-02d: FA3 missing, seen only in good.json)
            print("\n".join(f"  {line}" for line in rec["log_tail"][-3:]), flush=True)
    _gather(work)


@functools.lru_cache(maxsize=None)
def _compose_cached(ov: tuple[str, ...]):
    from hydra import compose, initialize_config_dir

    from pipeline.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(ov))


def _compose(ov: list[str]):
    """The run's config from the bench's overrides, composed once for every use in this process."""
    return _compose_cached(tuple(ov))


def missing_serve_args(good: Path, ov: list[str]) -> list[str]:
    """The export.serve.sglang_args of the overrides that the export's serve.sh (written at export time, from
    the overrides the export stage ran with) does not carry: serving it would not be the server asked for."""
    if not (good / "serve.sh").exists():
        return []
    cfg = _compose(ov)
    have = shlex.split((good / "serve.sh").read_text())
    want = [str(x) for x in (cfg.export.serve.sglang_args or [])]
    return [w for w in want if w not in have]


def write_prompts(prompts_file: Path, ov: list[str], run_dir: Path) -> None:
    """The held-out eval prompts (token ids) of the run, as the evaluate stage picks them."""
    from pipeline.stages.evaluate import heldout_prompts
    from pipeline.formats import feature_store as fs

    cfg = _compose(ov)
    store = fs.FeatureStore(run_dir / "features")
    prompts_file.write_text(json.dumps({"max_new_tokens": cfg.eval.max_new_tokens, "prompts": heldout_prompts(
        cfg, store, cfg.eval.num_prompts, cfg.eval.prompt_tokens)}))


def graph_baseline(target: str, prompts, max_new: int, log: Path, left: float) -> dict:
    """The no-speculation server with CUDA graphs ON (SGLang's default), output tokens/s at concurrency 1 and 8."""
    line = (f"python -m sglang.launch_server --model-path {target} --dtype bfloat16 --attention-backend triton "
            f"--port {GRAPH_PORT} --mem-fraction-static 0.3")
    info = start_server(line, log, GRAPH_PORT, max(60, min(420, left - 60)))
    proc = info.pop("proc")
    rec: dict = {"server": info}
    if info["started"]:
        url = f"http://127.0.0.1:{GRAPH_PORT}"
        generate(url, prompts[:4], max_new, 4)  # warm-up
        for conc in (1, 8):
            g = generate(url, prompts, max_new, conc)
            g.pop("outputs", None)
            g["tokens_per_s"] = g["completion_tokens"] / g["wall_s"] if g.get("wall_s") else None
            rec[f"generate_c{conc}"] = g
        rec["server_info_version"] = _server_version(url)
    else:
        rec["log_tail"] = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
    rec["log_lines"] = log_lines(log)
    stop_server(info["pgid"], proc)
    return rec


def margins(base_url: str, prompts, work: Path) -> dict:
    """Greedy equality, item 5: where the speculative server's greedy output first differs from the plain
    server's, the plain server's own top-1 / top-2 log-prob margin there, beside the margins at every other
    position of the same outputs (from one prefill over prompt + plain output, input_top_logprobs)."""
    import httpx

    good, base = work / "good.json", work / "baseline.json"
    if not good.exists() or not base.exists():
        return {"error": "needs good.json and baseline.json"}
    plain = json.loads(base.read_text())["generate"]["outputs"]
    spec = json.loads(good.read_text())["generate"]["outputs"]
    cmp_ = compare(spec, plain)
    rows, all_m, aligned, total = [], [], 0, 0
    with httpx.Client(timeout=120) as client:
        for i, (p, out) in enumerate(zip(prompts, plain)):
            if not out:
                continue
            r = client.post(base_url + "/generate", json={
                "input_ids": p + out, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": len(p), "top_logprobs_num": 2})
            top = r.json()["meta_info"]["input_top_logprobs"]  # entry k: the distribution that predicts out[k]
            m = []
            for k, tok in enumerate(out):
                e = top[k] if k < len(top) else None
                if not e or len(e) < 2:
                    m.append(None)
                    continue
                total += 1
                aligned += int(e[0][1] == tok)
                m.append(float(e[0][0]) - float(e[1][0]))
            all_m += [x for x in m if x is not None]
            d = next((d for d in cmp_["differing"] if d["prompt"] == i), None)
            if d is not None and d["first_diff"] < len(out):
                pos = d["first_diff"]
                e = top[pos] if pos < len(top) else None
                rows.append({"prompt": i, "first_diff": pos, "plain_token": out[pos], "spec_token": spec[i][pos]
                             if pos < len(spec[i]) else None, "margin": m[pos],
                             "spec_token_is_plain_top2": bool(e and len(e) > 1 and spec[i][pos] == e[1][1])})
    q = sorted(all_m)

    def pct(x):
        return q[min(len(q) - 1, int(x * len(q)))] if q else None
    diff_m = [r["margin"] for r in rows if r["margin"] is not None]
    return {"compared": cmp_["compared"], "equal": cmp_["equal"], "differing": rows,
            "top1_is_plain_greedy_token": aligned / total if total else None,
            "margins_all_positions": {"n": len(q), "p01": pct(0.01), "p05": pct(0.05), "p50": pct(0.5),
                                      "share_below_0.05": sum(x < 0.05 for x in q) / len(q) if q else None},
            "margins_at_first_diff": {"n": len(diff_m), "max": max(diff_m) if diff_m else None,
                                      "median": sorted(diff_m)[len(diff_m) // 2] if diff_m else None}}


def _server_version(url: str):
    import httpx
    try:
        info = httpx.get(url + "/server_info", timeout=30).json()
        return {"version": info.get("version"), "speculative_algorithm": info.get("speculative_algorithm"),
                "attention_backend": info.get("attention_backend"), "cuda_graph_disabled": info.get("disable_cuda_graph"),
                "speculative_num_steps": info.get("speculative_num_steps"),
                "speculative_eagle_topk": info.get("speculative_eagle_topk"),
                "speculative_num_draft_tokens": info.get("speculative_num_draft_tokens"),
                "avg_spec_accept_length": ((info.get("internal_states") or [{}])[0] or {}).get("avg_spec_accept_length")}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _gather(work: Path) -> None:
    """WORK/sglang_serving.json: every case, outputs left out (they stay in WORK/CASE.json)."""
    allc = {}
    for f in sorted(work.glob("*.json")):
        if f.name in ("sglang_serving.json", "prompts.json") or f.name.startswith("online_"):
            continue
        rec = json.loads(f.read_text())
        g = rec.get("generate")
        if isinstance(g, dict):
            g = dict(g)
            g.pop("outputs", None)
            rec["generate"] = g
        allc[f.stem] = rec
    (work / "sglang_serving.json").write_text(json.dumps(allc, indent=1))


if __name__ == "__main__":
    main()
