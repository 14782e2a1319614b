"""The GPU check, one run (< 8 minutes on one H200): kernel correctness at real
shapes; FP8 GEMM TFLOP/s against bf16 at a 1.5B Qwen2's linear shapes; decode
step time of a 1.5B-shaped model (the engine's runner: CUDA graph, paged Triton attention) against
the weight-bandwidth floor, bf16 and FP8; engine tok/s with the default models.
Writes gpu_check.json into --out and prints a table last.

    python -m latency_bench gpu-check --out results/
    python -m latency_bench gpu-check --dry-run --out /tmp/check   # CPU, interpreter, seconds

CUDA events after warm-up, medians; random inputs (no zeros); L2 flushed
between GEMM timings. Each section records its error and the rest still run.
The decode step is the engine's own: its model runner, attention metadata,
Triton backend and CUDA graphs.

One file past 300 lines on purpose: it is the single script a lent GPU
machine runs in one call, every section in it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import msgspec  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def from_checkout(name: str, folder: Path) -> None:
    """Package `name` imported from this checkout's `folder` where it is not
    installed (a lent GPU machine gets the working tree): as a file,
    `python latency_bench/gpu_check.py` has latency_bench/, not the root, on
    sys.path; and kernels/ has no __init__.py (on purpose: pyproject.toml says
    why), so `completer_kernels` is what the install maps it to, a package
    whose modules are kernels/'s files."""
    if importlib.util.find_spec(name) is not None:
        return
    if (init := folder / "__init__.py").exists():
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    else:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    if spec.loader is not None:
        spec.loader.exec_module(module)


from_checkout("completer_kernels", ROOT / "kernels")
from_checkout("completer", ROOT / "completer")

from completer import fp8  # noqa: E402
from completer.fp8 import Fp8Linear, quantize_linears  # noqa: E402
from completer.model import ModelConfig, Transformer  # noqa: E402
from completer_kernels.fp8_gemm import (expand_block_scales, fp8_gemm_blockwise, fp8_gemm_rowwise,  # noqa: E402
                                        gemm_configs)
from completer_kernels.fp8_quant import (quantize_fp8_blockwise_weight, quantize_fp8_groupwise,  # noqa: E402
                                         quantize_fp8_groupwise_torch, quantize_fp8_rowwise,
                                         quantize_fp8_rowwise_torch)
from completer_kernels.paged_attention import paged_decode_attention, paged_decode_attention_torch  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
CUDA = DEV.type == "cuda"
# A 1.5B Qwen2 (Qwen2.5-1.5B's shapes); the dry run shrinks every dimension.
QWEN_1_5B = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=1536,
                        intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, head_dim=128, max_position_embeddings=32768,
                        rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True)
TINY = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=160,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=True)
CFG = TINY if DRY else QWEN_1_5B
d, f, kv = CFG.hidden_size, CFG.intermediate_size, CFG.num_key_value_heads * CFG.head_dim
LINEARS = {"q,o": (d, d), "k,v": (kv, d), "gate,up": (f, d), "down": (d, f)}  # name: (N, K)
GEMM_M = (1, 16) if DRY else (1, 16, 256, 4096)
REPS, WARMUP = (2, 1) if DRY else (30, 3)
ROWS: list[tuple[str, str, str, str]] = []  # section, measure, figure, note


def timed(fn, reps: int = REPS, warmup: int = WARMUP, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of fn() after warm-up; flush (a big buffer) is rewritten before each run."""
    for _ in range(warmup):
        fn()
    if not CUDA:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    events = []
    torch.cuda.synchronize()
    for _ in range(reps):
        if flush is not None:
            flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def randn(*shape, dtype=torch.bfloat16, std=1.0):
    return (torch.randn(*shape, device=DEV) * std).to(dtype)


# -- 1. correctness at real shapes --------------------------------------------------

def bf16_of_exact(y: torch.Tensor, x_deq: torch.Tensor, w_deq: torch.Tensor) -> bool:
    """y within bf16 rounding (half an ulp; a full one under the interpreter, which
    truncates) plus fp32 accumulation (against sum |x||w|) of the exact product."""
    exact = x_deq.double() @ w_deq.double().T
    bound = exact.abs() * (2**-7 if DRY else 2**-8) + 1e-5 * (x_deq.abs() @ w_deq.abs().T).double()
    return bool(((y.double() - exact).abs() <= bound).all())


def check_kernels() -> dict:
    out = {}
    M = 8 if DRY else 256
    for name, (N, K) in LINEARS.items():
        x, w = randn(M, K, std=3.0), randn(N, K, std=0.03)
        (xq, xs), (rq, rs) = quantize_fp8_rowwise(x), quantize_fp8_rowwise_torch(x)
        (gq, gs), (rgq, rgs) = quantize_fp8_groupwise(x), quantize_fp8_groupwise_torch(x)
        row = {"quant_byte_mismatch": float((xq.view(torch.uint8) != rq.view(torch.uint8)).float().mean()
                                            + (gq.view(torch.uint8) != rgq.view(torch.uint8)).float().mean()),
               "quant_scales_equal": torch.equal(xs, rs) and torch.equal(gs, rgs)}
        wq, ws = quantize_fp8_rowwise_torch(w)
        bq, bs = quantize_fp8_blockwise_weight(w)
        x_deq, w_deq = xq.float() * xs[:, None], wq.float() * ws[:, None]
        gx, bw = gq.float() * expand_block_scales(gs, M, K, 1), bq.float() * expand_block_scales(bs, N, K, 128)
        gemms = {"triton_rowwise": (lambda: fp8_gemm_rowwise(xq, wq, xs, ws), x_deq, w_deq),
                 "scaled_mm": (lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                                        out_dtype=torch.bfloat16), x_deq, w_deq),
                 "triton_blockwise": (lambda: fp8_gemm_blockwise(gq, bq, gs, bs), gx, bw)}
        for label, (gemm, a, b) in gemms.items():
            try:
                row[f"{label}_within_bound"] = bf16_of_exact(gemm(), a, b)
            except Exception as e:  # report, keep going
                row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:200]
        true = x.float() @ w.float().T  # what fp8 costs against the unquantized product
        row["rowwise_rel_err_vs_bf16_inputs"] = float((x_deq @ w_deq.T - true).norm() / true.norm())
        row["blockwise_rel_err_vs_bf16_inputs"] = float((gx @ bw.T - true).norm() / true.norm())
        out[f"gemm_{name}"] = row
        ok = row["quant_byte_mismatch"] == 0 and row["quant_scales_equal"] and \
            row.get("triton_rowwise_within_bound") and row.get("triton_blockwise_within_bound")
        ROWS.append(("correctness", f"quant + GEMMs {name} M={M} N={N} K={K}", "pass" if ok else "FAIL",
                     f"scaled_mm {row.get('scaled_mm_within_bound', 'error')}; fp8 err "
                     f"{row['rowwise_rel_err_vs_bf16_inputs']:.3f} row / "
                     f"{row['blockwise_rel_err_vs_bf16_inputs']:.3f} block"))
    B, bs = (3, 4) if DRY else (8, 16)
    lens = torch.tensor([1, 17, 30] if DRY else [1, 16, 17, 255, 1000, 2049, 3000, 4096], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    tables = (torch.randperm(B * width) + 1).view(B, width).int().to(DEV)
    pool_shape = ((B * width + 1) * bs, CFG.num_key_value_heads, CFG.head_dim)
    k_pool, v_pool = randn(*pool_shape, dtype=torch.float32), randn(*pool_shape, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        q = randn(B, CFG.num_attention_heads, CFG.head_dim, dtype=dtype)
        got = paged_decode_attention(q, k_pool, v_pool, tables, lens.to(DEV), bs,
                                     partition=8 if DRY else 512, tile=4 if DRY else 64)
        ref = paged_decode_attention_torch(q, k_pool, v_pool, tables, lens.to(DEV), bs)
        err = float((got.float() - ref.float()).abs().max())
        bound = 1e-4 if dtype == torch.float32 else 2**-7 * float(ref.float().abs().max())
        out[f"paged_attention_{str(dtype)[6:]}"] = {"max_abs_err": err, "bound": bound, "pass": err <= bound}
        ROWS.append(("correctness", f"paged decode attention q {str(dtype)[6:]}, contexts up to {int(lens.max())}",
                     "pass" if err <= bound else "FAIL", f"max err {err:.1e} (bound {bound:.1e})"))
    out["paged_attention_verify"] = check_verify_pass(tables, lens, bs)
    return out


def check_verify_pass(tables: torch.Tensor, lens: torch.Tensor, bs: int) -> dict:
    """A speculative verify pass (1 to 9 new tokens per row) through the engine's
    Triton backend against its gather + SDPA torch backend, on the same pool."""
    from completer.engine.attention import AttentionMetadata, TorchAttention, TritonAttention
    from completer.engine.paged_kv import KVPool

    cfg = msgspec.structs.replace(CFG, num_hidden_layers=1)
    B = len(lens)
    num_new = [min(1 + i % 9, int(n)) for i, n in enumerate(lens)]
    T = max(num_new)
    rows = [r.tolist() for r in tables.cpu()]
    q = randn(B, cfg.num_attention_heads, T, cfg.head_dim, dtype=torch.float32)
    k, v = (randn(B, cfg.num_key_value_heads, T, cfg.head_dim, dtype=torch.float32) for _ in range(2))
    meta = AttentionMetadata.build(rows, [int(n) - k for n, k in zip(lens, num_new)], num_new, bs, DEV)
    outs = []
    for backend in (TorchAttention, TritonAttention):
        pool = KVPool(cfg, int(tables.max()) + 1, bs, device=DEV)
        torch.manual_seed(0)
        pool.k.normal_()
        pool.v.normal_()
        outs.append(backend(pool, meta).attend(0, q, k, v, meta.positions))
    valid = (torch.arange(T)[None, :] < torch.tensor(num_new)[:, None]).to(DEV)
    err = float((outs[1] - outs[0]).transpose(1, 2)[valid].abs().max())
    ROWS.append(("correctness", f"verify pass (1-{T} new tokens per row) kernel vs gather",
                 "pass" if err <= 1e-4 else "FAIL", f"max err {err:.1e} (bound 1.0e-04)"))
    return {"max_abs_err": err, "bound": 1e-4, "pass": err <= 1e-4}


# -- 2. GEMM throughput ---------------------------------------------------------------

def gemm_throughput() -> dict:
    out = {}
    flush = torch.empty(256 * 2**20 if CUDA else 1, dtype=torch.int8, device=DEV)  # > H200's L2
    for name, (N, K) in LINEARS.items():
        w = randn(N, K, std=0.03)
        layer = Fp8Linear(*quantize_fp8_rowwise_torch(w))
        for M in GEMM_M:
            x = randn(M, K)
            xq, xs = quantize_fp8_rowwise(x)
            flops = 2 * M * N * K
            ms = {"bf16_matmul": timed(lambda: torch.matmul(x, w.T), flush=flush)}
            best = None
            for config in gemm_configs(M)[: 1 if DRY else None]:
                try:
                    t = timed(lambda: fp8_gemm_rowwise(xq, layer.weight, xs, layer.weight_scale, config=config),
                              flush=flush)
                    best = min(best or (t, config), (t, config))
                except Exception as e:
                    out[f"{name}_M{M}_triton_{config}_error"] = str(e)[:200]
            if best:
                ms["fp8_triton"] = best[0]
            try:
                ms["fp8_scaled_mm"] = timed(lambda: torch._scaled_mm(
                    xq, layer.weight.t(), scale_a=xs[:, None], scale_b=layer.weight_scale[None, :],
                    out_dtype=torch.bfloat16), flush=flush)
            except Exception as e:  # e.g. no row-wise scaling on this GPU
                out[f"{name}_M{M}_scaled_mm_error"] = str(e)[:200]
            ms["fp8_linear_with_quant"] = timed(lambda: layer(x), flush=flush)
            tflops = {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()}
            out[f"{name}_M{M}"] = {"N": N, "K": K, "ms": ms, "tflops": tflops,
                                   "best_triton_config": best and best[1]}
            fp8_best = min(v for k, v in ms.items() if k.startswith("fp8") and k != "fp8_linear_with_quant")
            ROWS.append(("GEMM", f"{name} M={M} N={N} K={K}",
                         " / ".join(f"{tflops[k]:.3g}" for k in ms) + " TFLOP/s",
                         f"{' / '.join(ms)}; fp8 GEMM {ms['bf16_matmul'] / fp8_best:.2f}x bf16"))
    return out


# -- 3. decode step against the bandwidth floor ---------------------------------------

def production_step(model: Transformer, batch: int, context: int, graphs: bool):
    """One plain decode step as the engine runs it: the model runner builds the
    pass's attention metadata and runs the Triton backend, or replays its CUDA
    graph; every row sits at `context` tokens (its new token's K/V is written
    over at each call)."""
    from completer.engine.block_manager import BlockManager
    from completer.engine.kv_cache_manager import restart
    from completer.engine.model_runner import ModelRunner
    from completer.engine.paged_kv import KVPool
    from completer.engine.sequence import CacheState

    bs = 16
    pool = KVPool(model.config, batch * -(-context // bs) + 2, bs, device=DEV)
    pool.k.normal_()
    pool.v.normal_()
    runner = ModelRunner(model, pool, "triton", cuda_graphs=graphs)
    blocks = BlockManager(pool.num_blocks, bs, prefix_cache=False)
    states = [CacheState() for _ in range(batch)]
    for state in states:
        blocks.grow(state.table, context)
        restart(state, context - 1)
    rows = [[int(t)] for t in torch.randint(1, model.config.vocab_size, (batch,))]

    def step() -> None:  # (the same position each time: a pass leaves `computed` as it is)
        runner.execute(states, rows, last_only=True)

    return step


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    n = (2**30 if CUDA else 2**24) // 4
    src, dst = randn(n, dtype=torch.float32), torch.empty(n, device=DEV)
    return 2 * n * 4 / (timed(lambda: dst.copy_(src), reps=REPS) * 1e-3)


def weight_bytes(model: Transformer) -> int:
    """Bytes one decode step reads: every weight once (a tied lm_head is the embedding)."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen or name == "inv_freq":
            continue
        if name == "model.embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue  # a lookup reads a row; the untied lm_head is counted
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_step() -> dict:
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(CFG).eval()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)  # no zeros
    model = model.to(torch.bfloat16)
    bw = copy_bandwidth()
    out = {"copy_bandwidth_GBps": bw / 1e9}
    context = 20 if DRY else 1024
    for precision in ("bf16", "fp8"):
        if precision == "fp8":
            quantize_linears(model)
        floor_ms = weight_bytes(model) / bw * 1e3
        for batch in ((1, 2) if DRY else (1, 8)):
            with torch.inference_mode():
                eager = timed(production_step(model, batch, context, graphs=False), reps=REPS)
                graph = timed(production_step(model, batch, context, graphs=True), reps=REPS * 2) if CUDA else None
            best = graph or eager
            kv_bytes = 2 * CFG.num_hidden_layers * batch * context * kv * 4
            out[f"{precision}_b{batch}"] = {
                "eager_ms": eager, "graph_ms": graph, "floor_ms": floor_ms, "weight_bytes": weight_bytes(model),
                "floor_with_kv_ms": floor_ms + kv_bytes / bw * 1e3, "tok_per_s": batch / (best * 1e-3)}
            ROWS.append(("decode", f"{precision} batch {batch}, context {context}",
                         f"{best:.3f} ms/step ({'graph' if graph else 'eager'}; eager {eager:.3f})",
                         f"{best / floor_ms:.2f}x the {floor_ms:.3f} ms weight floor"))
    return out


# -- 4. engine tok/s with the default models ------------------------------------------

async def engine_run(target, draft, spec_on: bool, documents: list, max_tokens: int) -> dict:
    from completer.config import Config, EngineConfig, ModelSection, RequestSection, SpecConfig
    from completer.pipeline import LocalCompleter, RequestOptions

    config = Config(model=ModelSection(context_tokens=(128 if DRY else 768) + 64),
                    engine=EngineConfig(kv_cache_mb=256), spec=SpecConfig(draft_model=spec_on, ngram=spec_on),
                    request=RequestSection(deadline_ms=600_000))
    options = RequestOptions(max_tokens=max_tokens, mode="free")
    async with LocalCompleter(target, draft if spec_on else None, config) as completer:
        await completer.stream(documents[0], options=options).finished()  # compiles, GEMM choices
        tokens, proposed, accepted, decode_ms = 0, 0, 0, 0.0
        started = time.perf_counter()
        for document in documents:  # batch 1, one after another
            t = (await completer.stream(document, options=options).finished()).timings
            tokens += t.generated_tokens
            proposed += t.draft_proposed
            accepted += t.draft_accepted
            decode_ms += t.total_ms - t.ttft_ms
        wall = time.perf_counter() - started
    return {"tok_per_s": tokens / wall, "decode_tok_per_s": (tokens - len(documents)) / max(decode_ms / 1e3, 1e-9),
            "tokens": tokens, "acceptance": accepted / proposed if proposed else None}


def engine_tok_s() -> dict:
    from completer.loading import load
    from completer.model_store import EMBEDDED_DRAFT, EMBEDDED_TARGET
    from completer.protocol import Document

    out = {}
    sources = sorted((ROOT / "completer").rglob("*.py"))[: 1 if DRY else 8]
    for precision in ("bf16", "fp8"):
        target = load(EMBEDDED_TARGET, precision, device=str(DEV))
        draft = load(EMBEDDED_DRAFT, precision, device=str(DEV))
        documents = []
        for path in sources:
            text = path.read_text()
            cut = text.find("\n", len(text) // 2) + 1
            documents.append(Document(path.as_uri(), text[:cut], text[cut:]))
        for spec_on in (False, True):
            r = asyncio.run(engine_run(target, draft, spec_on, documents, 6 if DRY else 64))
            out[f"{precision}_spec_{'on' if spec_on else 'off'}"] = r
        off, on = out[f"{precision}_spec_off"], out[f"{precision}_spec_on"]
        ROWS.append(("engine", f"default models {precision}, batch 1, spec off -> on",
                     f"{off['tok_per_s']:.0f} -> {on['tok_per_s']:.0f} tok/s "
                     f"(decode only {off['decode_tok_per_s']:.0f} -> {on['decode_tok_per_s']:.0f})",
                     f"{on['tok_per_s'] / off['tok_per_s']:.2f}x"
                     + (f", acceptance {on['acceptance']:.0%}" if on["acceptance"] is not None else "")))
    return out


SECTIONS = {"kernels": check_kernels, "gemm": gemm_throughput, "decode": decode_step, "engine": engine_tok_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--budget-s", type=float, default=420.0, help="skip sections that would start later")
    args = p.parse_args()
    if not CUDA and not DRY:
        p.error("no CUDA device: run with --dry-run")
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if CUDA else "cpu (dry run)" if DRY else "cpu"
    results: dict = {"device": device, "dry_run": DRY, "torch": torch.__version__, "sections": {}}
    for name in args.only:
        if time.perf_counter() - started > args.budget_s:
            results["sections"][name] = {"skipped": "time budget"}
            ROWS.append((name, "skipped", "time budget", ""))
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)
        try:
            results["sections"][name] = SECTIONS[name]()
        except Exception as e:  # the other sections still run
            results["sections"][name] = {"error": traceback.format_exc()}
            ROWS.append((name, "ERROR", f"{type(e).__name__}: {e}"[:120], "see JSON"))
        results["sections"].setdefault(name, {})["seconds"] = time.perf_counter() - t0
    results["fp8_emulation"] = not (CUDA and fp8.has_fp8_tensor_cores(DEV))
    results["seconds"] = time.perf_counter() - started
    results["rows"] = ROWS
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpu_check on {device}, {results['seconds']:.0f} s")
    for col in ("section", "measure", "figure", "note"):
        table.add_column(col)
    for row in ROWS:
        table.add_row(*row)
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
