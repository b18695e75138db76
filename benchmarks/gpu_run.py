"""The translator on a GPU, all in one run: the hardware's peak, a profile of the ``gpu`` preset's step,
training in both directions with several seeds, and scoring on ``test_2016_flickr`` with and without the
KV-cache. Everything goes into one JSON that chapter 11 reads (``book/results/gpu.json``).

    python benchmarks/gpu_run.py --data-dir ../shared/data/multi30k --out runs/gpu        # on a GPU
    python benchmarks/gpu_run.py --dry-run --data-dir ../shared/data/multi30k --out /tmp/g  # the same, tiny, on CPU

The parts, in order:

1. **Peak**: the bf16 (float32 on a CPU) rate of a large matrix product, measured here: MFU is
   achieved FLOP/s over it, so it is never a datasheet number.
2. **Profile**: 20 steps of the preset's training step, exactly the trainer's (:func:`train_step`,
   compiled if the preset compiles), after warm-up, under ``torch.profiler``: the wall time, the time
   the host spent issuing the steps, the device's busy time (its kernels' time over the wall time),
   tokens per second and model FLOP utilisation (FLOPs counted by ``torch.utils.flop_counter`` on one step).
3. **Training**: one process per seed, all at once on the one GPU (a model of this size leaves most
   of a GPU idle, so several runs share it); each trains its seed in every direction one after the
   other with the trainer (:func:`.train.train`, the preset with its own seed and the ``--set``
   overrides), so it compiles the model once: a second model of the same shape reuses the compiled
   code, where six processes compiling at once spent most of a short budget on it. Each run is
   scored on ``val`` and ``test_2016_flickr`` with the preset's beam search; the first seed also
   decodes without the KV-cache. Every run keeps its translations, so each score and its bootstrap
   interval can be recomputed from the JSON (``--import-report``).

``--sweep`` instead trains one seed of each ``--variant`` (a JSON object of settings) in one
direction and scores ``val`` only, averaging the last 1, 5 and all kept (10) checkpoints: how the preset's
settings are chosen, on ``val`` alone. Not a test: ``tests/test_gpu_run.py`` runs ``--dry-run``.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # the compiled step cannot trace the shape checks

import torch  # noqa: E402

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of the mean of ``repeats`` products of two ``size`` × ``size`` matrices, after three warm-ups."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(config, data_dir: Path | None, device: torch.device, steps: int = 20, warmup_steps: int = 30,
                 prepared: tuple | None = None) -> dict:
    """The trainer's step on the preset's real batches: wall, host and device time per step, tokens/s and FLOPs.

    ``prepared``: the ``prepare_data`` result to reuse (a second profile of the same data)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    from stepformer.runs import Distributed
    from stepformer.translator.batching import PaddedTable, token_batches
    from stepformer.translator.config import autocast_dtype
    from stepformer.translator.fast import loss_for
    from stepformer.translator.model import build_model, compile_model
    from stepformer.translator.train import make_optimizer, prepare_data, train_step

    torch.manual_seed(config.seed)
    tokenizer, train_data, _, _ = prepared or prepare_data(config, Path("/nonexistent"), data_dir, False,
                                                           lambda m: None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(config, tokenizer.vocab_size, tokenizer.pad_id).to(device).train()
    optimizer = make_optimizer(model, config, device)
    amp_dtype = autocast_dtype(config.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)
    forward = compile_model(model) if config.compile else model
    table = PaddedTable(train_data, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, device)
    batches = token_batches(train_data, config.max_tokens, config.seed, 0)
    needed = warmup_steps + steps
    batches = (batches * (needed // len(batches) + 1))[:needed]
    indices = table.indices(batches)
    loss_fn, world = loss_for(device), Distributed(device=device)

    def step(i: int):
        return train_step(forward, model, optimizer, scaler, table, batches[i], indices[i], tokenizer.pad_id, config,
                          config.peak_lr * 0.1, amp_dtype, loss_fn, world)

    started = time.perf_counter()
    for i in range(warmup_steps):
        step(i)
    sync(device)
    warmup_s = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(steps):  # the same steps' time without the profiler's own overhead
        step(warmup_steps + i)
    sync(device)
    unprofiled = time.perf_counter() - started
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        results = [step(warmup_steps + i) for i in range(steps)]
        issued = time.perf_counter() - started
        sync(device)
        wall = time.perf_counter() - started
    tokens = int(sum(float(r[1]) for r in results))
    device_s = busy_seconds(prof) if device.type == "cuda" else None
    counter = FlopCounterMode(display=False)
    src, tgt_in, tgt_out = table.batch(batches[warmup_steps], indices[warmup_steps])
    with counter, torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        loss_fn(model(src, tgt_in), tgt_out, tokenizer.pad_id, config.label_smoothing).backward()
    optimizer.zero_grad(set_to_none=True)
    flops_one = counter.get_total_flops()
    mean_tokens = tokens / steps
    step_tokens = int((tgt_out != tokenizer.pad_id).sum())
    return {
        "steps": steps, "warmup_steps": warmup_steps, "warmup_and_compile_s": round(warmup_s, 2),
        "wall_ms_per_step": round(wall / steps * 1e3, 3),
        "unprofiled_ms_per_step": round(unprofiled / steps * 1e3, 3),
        "host_ms_per_step": round(issued / steps * 1e3, 3),
        "device_ms_per_step": None if device_s is None else round(device_s / steps * 1e3, 3),
        "device_busy": None if device_s is None else round(device_s / wall, 4),
        "tokens_per_s": round(tokens / unprofiled, 1), "target_tokens_per_step": round(mean_tokens, 1),
        # FLOPs of one counted step, scaled to the profiled steps' mean target tokens.
        "flops_per_step": flops_one * mean_tokens / max(step_tokens, 1),
        "parameters": sum(p.numel() for p in model.parameters()), "precision": str(amp_dtype or torch.float32),
        "compiled": config.compile,
    }


def busy_seconds(prof) -> float:
    """The time at least one GPU kernel ran: the union of the profiled kernels' intervals (overlaps count once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6


def run_group(args: argparse.Namespace) -> None:
    """One seed (and variant) in each of ``args.direction``'s directions, one after another in this process,
    so that the model is compiled once: a second model of the same shape reuses the compiled code. Each run's
    JSON goes to ``<result>-<src>-<tgt>.json``."""
    for direction in args.direction.split(","):
        run_one(args, direction, Path(f"{args.out}-{direction}"), Path(f"{args.result}-{direction}.json"))


def run_one(args: argparse.Namespace, direction: str, folder: Path, result_path: Path) -> None:
    """One (direction, seed, variant): train with the trainer, then score; its JSON into ``result_path``."""
    from stepformer.runs import average_checkpoints, checkpoint_paths, load_checkpoint
    from stepformer.translator.config import preset
    from stepformer.translator.data import load_split
    from stepformer.translator.evaluate import Translator, scores
    from stepformer.translator.train import train

    src, tgt = direction.split("-")
    settings = json.loads(args.settings)
    config = preset(args.preset).with_overrides({**settings, "src_lang": src, "tgt_lang": tgt, "seed": str(args.seed)})
    started = time.perf_counter()
    with open(folder.with_suffix(".log"), "w") as train_log, contextlib.redirect_stderr(train_log):
        train(config, folder, args.data_dir, progress=False)
    train_wall = time.perf_counter() - started
    state = load_checkpoint(folder / "averaged.pt")
    result = {"direction": f"{src}→{tgt}", "seed": args.seed, "settings_given": settings,
              "settings": state["config"], "steps": state["step"],
              "train_minutes": round(state["elapsed_s"] / 60, 2), "train_wall_minutes": round(train_wall / 60, 2),
              "train_commit": state["commit"], "hardware": state["hardware"], "torch": state["torch"],
              "averaged": state.get("averaged", []), "scores": {}}
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    result["epochs"] = max((m["epoch"] for m in metrics if "epoch" in m), default=0)
    result["validation_curve"] = [{k: m[k] for k in ("step", "val_loss", "val_bleu")} for m in metrics
                                  if "val_bleu" in m]
    splits = ["val"] if args.sweep else ["val", "test_2016_flickr"]
    candidates = {"averaged": folder / "averaged.pt"}
    if args.sweep:
        paths = checkpoint_paths(folder)
        for k in (1, 5):
            if k <= len(paths):
                candidates[f"last_{k}"] = average_checkpoints(paths[-k:], folder / f"averaged_{k}.pt")
    for name, path in candidates.items():
        translator = Translator.load(path)
        for split in splits:
            sources, references = load_split(split, src, tgt, args.data_dir, progress=False)
            if args.limit:
                sources, references = sources[: args.limit], references[: args.limit]
            caches = (True, False) if (args.no_cache_too and split == "test_2016_flickr") else (True,)
            penalties = [float(x) for x in args.length_penalties.split(",")] if args.length_penalties else [None]
            for use_cache, penalty in [(c, lp) for c in caches for lp in penalties]:
                sync(translator.device)
                decode_started = time.perf_counter()
                hypotheses = translator.translate(sources, length_penalty=penalty, use_cache=use_cache)
                sync(translator.device)
                seconds = time.perf_counter() - decode_started
                key = (f"{name}/{split}" + ("" if use_cache else "/no_cache")
                       + ("" if penalty is None else f"/lp{penalty}"))
                result["scores"][key] = {**scores(hypotheses, references, tgt), "sentences": len(sources),
                                         "beam": translator.config.beam,
                                         "length_penalty": penalty or translator.config.length_penalty,
                                         "kv_cache": use_cache, "decode_seconds": round(seconds, 2),
                                         "hypotheses": hypotheses}
    result_path.write_text(json.dumps(result, ensure_ascii=False) + "\n")


def summarise(runs: list[dict], key: str) -> dict:
    """Per direction, BLEU and chrF of ``key`` (e.g. ``averaged/val``) over the seeds: mean, sample sd, n, values."""
    from stepformer.translator.evaluate import seed_summary

    out = {}
    for direction in sorted({r["direction"] for r in runs}):
        rows = [r["scores"][key] for r in runs if r["direction"] == direction and key in r["scores"]]
        if rows:
            out[direction] = {metric: {**seed_summary([r[metric] for r in rows]), "values": [r[metric] for r in rows]}
                              for metric in ("bleu", "chrf")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the runs and gpu_run.json")
    parser.add_argument("--data-dir", type=Path, help="a local Multi30k folder instead of the download")
    parser.add_argument("--preset", default=None, help="default: gpu (tiny with --dry-run)")
    parser.add_argument("--directions", default="de-en,en-de")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every run")
    parser.add_argument("--sweep", action="store_true", help="one seed per --variant, scored on val only")
    parser.add_argument("--variant", action="append", default=[], help='e.g. \'{"model.dropout": 0.3}\' (with --sweep)')
    parser.add_argument("--import-report", type=Path, metavar="GPU_RUN_JSON",
                        help="make a device run's report a results file of the book (--results), scored here")
    parser.add_argument("--results", type=Path, default=ROOT / "book" / "results" / "gpu.json")
    parser.add_argument("--report", type=Path, help="where gpu_run.json goes (default: --out), rewritten as runs end")
    parser.add_argument("--parallel", type=int, default=6, help="processes at once")
    parser.add_argument("--group", choices=("seed", "run"), default="seed",
                        help="seed: one process per seed, its directions one after another, compiled once "
                        "(default); run: one process per run")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny preset, few steps, few sentences, on the CPU")
    parser.add_argument("--limit", type=int, help="score only the first N sentences of each split")
    parser.add_argument("--length-penalties", help="with --sweep: score val with each, e.g. 1.0,1.4")
    # One (direction, seed, variant) in a process of its own: how the parallel runs are started.
    for name in ("--worker", "--direction", "--seed", "--settings", "--result", "--no-cache-too"):
        parser.add_argument(name, help=argparse.SUPPRESS, **({"action": "store_true"} if name in
                                                             ("--worker", "--no-cache-too") else {}))
    args = parser.parse_args(argv)
    if args.worker:
        args.seed = int(args.seed)
        run_group(args)
        return 0
    if args.import_report:
        import_report(args.import_report, args.results, args.data_dir)
        print(f"wrote {args.results}")
        return 0

    if args.out is None:
        parser.error("--out is required (except with --import-report)")
    from stepformer.runs import commit, hardware
    from stepformer.translator.config import pick_device, preset

    device = torch.device("cpu") if args.dry_run else pick_device()
    name = args.preset or ("tiny" if args.dry_run else "gpu")
    common = dict(item.split("=", 1) for item in args.set)
    if args.dry_run:
        common = {"max_steps": "12", "checkpoint_every": "3", "eval_every": "6", "eval_sentences": "20", **common}
        args.limit = args.limit or 30
    config = preset(name).with_overrides(common)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"schema": SCHEMA, "preset": name, "overrides": common, "dry_run": args.dry_run,
              "commit": commit(ROOT), "hardware": hardware(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode":
              "sweep" if args.sweep else "final"}
    started = time.perf_counter()
    peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report["peak"] = {"dtype": str(peak_dtype), "size": 8192 if device.type == "cuda" else 512,
                      "flops": matmul_peak(device, peak_dtype, 8192 if device.type == "cuda" else 512)}
    log(f"{report['hardware']}: {report['peak']['dtype']} matmul {report['peak']['flops'] / 1e12:.1f} TFLOP/s")
    if not args.no_profile:
        from dataclasses import replace

        from stepformer.translator.train import prepare_data

        prepared = prepare_data(config, Path("/nonexistent"), args.data_dir, False, lambda m: None)
        report["profile"] = {}
        # Eager first (no compilation to wait for), then compiled where the preset compiles.
        for compiled in sorted({False, config.compile}):
            try:
                profile = profile_step(replace(config, compile=compiled), args.data_dir, device,
                                       steps=3 if args.dry_run else 20, warmup_steps=2 if args.dry_run else 30,
                                       prepared=prepared)
            except Exception as error:  # a profile that fails must not cost the training runs
                report["profile"]["compiled" if compiled else "eager"] = {"error": repr(error)}
                log(f"profile failed: {error!r}")
                continue
            profile["mfu"] = round(profile["flops_per_step"] / (profile["unprofiled_ms_per_step"] / 1e3)
                                   / report["peak"]["flops"], 4)
            report["profile"]["compiled" if compiled else "eager"] = profile
            log("profile: " + ", ".join(f"{k}={v}" for k, v in profile.items()))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # A job is one process: its seed's runs in each of its directions, one after another (one compilation).
    directions = args.directions.split(",")
    if args.sweep:
        variants = [json.loads(v) for v in args.variant] or [{}]
        jobs = [((directions[0],), int(args.seeds.split(",")[0]), v, i) for i, v in enumerate(variants)]
    elif args.group == "seed":
        jobs = [(tuple(directions), int(s), {}, 0) for s in args.seeds.split(",")]
    else:
        jobs = [((d,), int(s), {}, 0) for d in directions for s in args.seeds.split(",")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    running, results, failures = [], [], []
    uncached = set()  # the directions whose first run also decodes without the cache
    queue = list(jobs)
    log(f"{sum(len(j[0]) for j in jobs)} runs in {len(jobs)} processes, {args.parallel} at a time")
    while queue or running:
        while queue and len(running) < args.parallel:
            job_directions, seed, variant, number = queue.pop(0)
            group = f"s{seed}" + (f"-v{number}" if args.sweep else "") + ("" if args.group == "seed" and not
                                                                            args.sweep else f"-{job_directions[0]}")
            settings = {**common, **{k: str(v) for k, v in variant.items()}}
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(args.out / group),
                       "--direction", ",".join(job_directions), "--seed", str(seed), "--settings",
                       json.dumps(settings), "--result", str(args.out / group), "--preset", name]
            if args.data_dir:
                command += ["--data-dir", str(args.data_dir)]
            if args.limit:
                command += ["--limit", str(args.limit)]
            if args.sweep:
                command.append("--sweep")
                if args.length_penalties:
                    command += ["--length-penalties", args.length_penalties]
            elif not set(job_directions) <= uncached:
                command.append("--no-cache-too")
                uncached |= set(job_directions)
            worker_log = open(args.out / f"{group}.worker.log", "w")  # noqa: SIM115 (closed when the job ends)
            running.append((group, job_directions, seed, number, subprocess.Popen(
                command, env=env, stdout=worker_log, stderr=worker_log, cwd=ROOT), worker_log, time.perf_counter()))
            log(f"started {group}: {', '.join(job_directions)}, seed {seed}, {settings}")
        time.sleep(1)
        for item in list(running):
            group, job_directions, seed, number, process, worker_log, began = item
            if process.poll() is None:
                continue
            running.remove(item)
            worker_log.close()
            for direction in job_directions:
                tag = f"{direction}-s{seed}" + (f"-v{number}" if args.sweep else "")
                result_file = args.out / f"{group}-{direction}.json"
                if result_file.is_file():
                    result = json.loads(result_file.read_text())
                    result["tag"], result["process_minutes"] = tag, round((time.perf_counter() - began) / 60, 2)
                    results.append(result)
                    log(f"done {tag}: {result['steps']} steps, {result['epochs']} epochs in {result['train_minutes']} "
                        f"min; BLEU {({k: v['bleu'] for k, v in result['scores'].items()})}")
                    continue
                tail = "".join((args.out / f"{group}.worker.log").read_text().splitlines(True)[-15:])
                with contextlib.suppress(OSError):
                    tail += "".join((args.out / f"{group}-{direction}.log").read_text().splitlines(True)[-15:])
                failures.append({"tag": tag, "returncode": process.returncode, "log_tail": tail})
                log(f"FAILED {tag} ({process.returncode}):\n{tail}")
            write_report(report, results, failures, started, args.report or args.out / "gpu_run.json")
    write_report(report, results, failures, started, args.report or args.out / "gpu_run.json")
    print_table(report)
    return 1 if failures else 0


def write_report(report: dict, results: list[dict], failures: list[dict], started: float, path: Path) -> None:
    """The report with the runs finished so far (rewritten as each ends: a run cut short keeps what it has)."""
    report["runs"] = sorted(results, key=lambda r: r["tag"])
    report["failures"] = failures
    report["summary"] = {"test_2016_flickr": summarise(results, "averaged/test_2016_flickr"),
                         "val": summarise(results, "averaged/val")}
    report["wall_minutes"] = round((time.perf_counter() - started) / 60, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, ensure_ascii=False, indent=1) + "\n")


def import_report(report_path: Path, results: Path, data_dir: Path | None) -> dict:
    """A device run's report made a results file of the book: every score recomputed here from the run's kept
    translations with :func:`.evaluate.scores` (bootstrap 95% intervals included), the translations of the
    averaged checkpoint written to ``translations/`` beside ``results`` (``hypotheses_file``), the others
    dropped after scoring, and each direction's mean ± sd over its seeds."""
    from stepformer.translator.data import load_split
    from stepformer.translator.evaluate import scores

    report = json.loads(report_path.read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{report_path} is not a gpu_run report of schema {SCHEMA}")
    folder = results.parent / "translations"
    folder.mkdir(parents=True, exist_ok=True)
    stem = results.stem
    for run in report["runs"]:
        src, tgt = run["direction"].split("→")
        for key, score in run["scores"].items():
            split = key.split("/")[1]
            hypotheses = score.pop("hypotheses")
            references = load_split(split, src, tgt, data_dir, progress=False)[1][: score["sentences"]]
            # Reports written before the device scored with evaluate.scores carry its own interval fields.
            for ad_hoc in ("bleu_bootstrap_mean", "bleu_ci95_halfwidth", "bleu_bootstrap_signature"):
                score.pop(ad_hoc, None)
            score.update(scores(hypotheses, references, tgt))
            cached_key = key.replace("/no_cache", "")
            if key != cached_key:
                # Decoding without the cache must give the same translations: kept as a check, not a file.
                kept = (folder.parent / run["scores"][cached_key]["hypotheses_file"]).read_text(encoding="utf-8")
                score["same_translations_as_cached"] = kept.splitlines() == hypotheses
            elif key.startswith("averaged/"):
                name = f"{stem}-{run['tag']}-{split}.txt"
                (folder / name).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
                score["hypotheses_file"] = f"translations/{name}"
    report["summary"] = {split: summarise(report["runs"], f"averaged/{split}") for split in ("test_2016_flickr", "val")}
    report["imported_from"] = report_path.name
    results.write_text(json.dumps(report, ensure_ascii=False, indent=1) + "\n")
    return report


def print_table(report: dict) -> None:
    print(f"\n{report['hardware']} | torch {report['torch']} | commit {report['commit']} | "
          f"{report['wall_minutes']} min in all")
    for kind, p in report.get("profile", {}).items():
        if "error" in p:
            print(f"step ({kind}): {p['error']}")
            continue
        print(f"step ({kind}): {p['wall_ms_per_step']} ms wall, {p['host_ms_per_step']} ms host, device busy "
              f"{p['device_busy']}, {p['tokens_per_s']:,.0f} tok/s, MFU {p['mfu']:.1%}, warmup "
              f"{p['warmup_and_compile_s']} s")
    for r in report["runs"]:
        scores = "  ".join(f"{k} {v['bleu']:.2f} [{v['bleu_ci95'][0]:.2f}, {v['bleu_ci95'][1]:.2f}] "
                           f"({v['decode_seconds']}s)"
                           for k, v in r["scores"].items())
        print(f"{r['tag']:>18} {r['train_minutes']:5.2f} min {r['steps']:6d} steps ep {r['epochs']:4d}  {scores}")
    for split, summary in report["summary"].items():
        for direction, s in summary.items():
            print(f"{split} {direction}: BLEU {s['bleu']['mean']} ± {s['bleu']['sd']} over {s['bleu']['n']} seeds "
                  f"{s['bleu']['values']}")


if __name__ == "__main__":
    sys.exit(main())
