"""Probe (GPU box with SGLang, issue #10): why the eager runner's static-buffer copy failed for a large extend.

Builds the capture ModelRunner (pipeline/engines/sglang_capture.build_runner), prints the eager registry's slot
shapes and the ForwardBatch's token/batch fields for a small and a large extend, then runs forward_capture with
SGLANG_EAGER_INPUT_NO_COPY off and on, printing the outcome of each. Diagnostic only: nothing is asserted.
  PYTHONPATH=/tmp/sgl-site:/tmp/site:$PWD python scripts/dev/sglang_capture_probe.py TARGET_DIR [backend] [mem]
"""

import os
import sys
import traceback

import torch

from pipeline.engines import sglang_capture as sc


def fb_shapes(runner, reqs, tree_cache) -> dict:
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

    try:
        batch = sc.extend_batch(reqs, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, tree_cache,
                                runner.model_config)
        fb = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                   return_hidden_states_before_norm=False)
        return {k: tuple(v.shape) for k, v in vars(fb).items() if isinstance(v, torch.Tensor)}
    finally:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()


def main(target_dir: str, backend: str = "triton", mem: str = "0.6") -> None:
    runner = sc.build_runner(target_dir, 0, 1, 29533, float(mem), backend)
    print("max_total_num_tokens", runner.max_total_num_tokens, "max_running_requests", runner.max_running_requests)
    reg = getattr(runner.eager_runner, "_eager_registry", None)
    for name, slot in (reg._slots.items() if reg else []):
        print("slot", name, slot.axis, None if slot.buffer is None else tuple(slot.buffer.shape))
    model = runner.model
    model.set_eagle3_layers_to_capture(sc.lay.sglang_layer_ids([1, 14, 26]))
    hook = sc.LastStateHook(model.model.norm)
    tree = sc.disabled_prefix_cache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
    g = torch.Generator().manual_seed(0)
    rid = 0
    for n_samples, length in ((2, 7), (64, 368)):
        samples = [torch.randint(10, 40000, (length,), generator=g).tolist() for _ in range(n_samples)]
        print(f"== {n_samples} x {length}:", fb_shapes(runner, sc.make_reqs(samples, rid), tree))
        rid += n_samples
        for flag in ("0", "1"):
            os.environ["SGLANG_EAGER_INPUT_NO_COPY"] = flag
            try:
                aux, last = sc.forward_capture(runner, sc.make_reqs(samples, rid), hook, tree)
                print(f"   NO_COPY={flag}: ok aux {tuple(aux.shape)} last {tuple(last.shape)} "
                      f"aux std {aux.float().std():.4f} last std {last.float().std():.4f}")
            except Exception as e:  # noqa: BLE001 (diagnostic: print and go on)
                print(f"   NO_COPY={flag}: {type(e).__name__}: {e}")
                traceback.print_exc(limit=-4)
            rid += n_samples


if __name__ == "__main__":
    main(*sys.argv[1:])
