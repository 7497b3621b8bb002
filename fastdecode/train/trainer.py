"""`fastdecode train-drafter`: self-distillation data from the target, then a head trained on it with the
training-time test; checkpointed, resumable and seeded (the same command gives the same head on the same machine)."""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastdecode.layers.rotary import rope_cache
from fastdecode.speculative.eagle.head import build_head, head_config_for, init_from_target, save_head
from fastdecode.train import data as D
from fastdecode.train.losses import accepted_length, eagle_logits, head_loss, mtp_logits, step_targets


@dataclass
class TrainOptions:
    model: str
    out: Path
    kind: str = "eagle"  # eagle | mtp
    data: tuple[str, ...] = ("chat", "code")
    data_dir: Path | None = None  # default OUT/data; share it between an eagle and an mtp run
    quant: str | None = "int4"  # the target's weight format while it makes the data (as it will decode)
    threads: int | None = None
    chat_prompts: int = 48
    answer_tokens: int = 192
    code_tokens: int = 60000
    window: int = 256  # training window (tokens); code is cut into windows of this size too
    draft_vocab: int = 8192
    steps: int = 3  # eagle: training-time-test depth; mtp: tokens predicted per pass
    epochs: float = 2.0
    batch: int = 8
    lr: float = 5e-4
    seed: int = 0
    checkpoint_every: int = 20
    holdout: float = 0.05  # share of windows kept out of training to measure acceptance


def make_data(o: TrainOptions, llm, taps: list[int], progress, log) -> Path:
    """Writes the shards that are missing (a rerun resumes); returns the data directory."""
    from fastdecode.engine.sampling import SamplingParams

    directory = o.data_dir or o.out / "data"
    spec = {"model": o.model, "taps": taps, "quant": o.quant, "data": list(o.data), "chat_prompts": o.chat_prompts,
            "answer_tokens": o.answer_tokens, "code_tokens": o.code_tokens, "window": o.window, "seed": o.seed}
    manifest = directory / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()) != spec:
        raise ValueError(f"{directory} holds data made with other settings; remove it or pass another --data-dir")
    directory.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(spec, indent=2))
    encode = llm.tokenizer.encode
    jobs: list[tuple[str, object]] = []  # ("chat", messages) | ("text", ids)
    for source in o.data:
        if source == "chat":
            jobs += [("chat", m) for m in D.chat_prompts(o.chat_prompts, o.seed)]
        elif source == "code":
            jobs += [("text", ids) for ids in D.code_sequences(encode, o.code_tokens, o.window, o.seed)]
        elif source.endswith(".jsonl"):
            from fastdecode.workloads import load_workload
            jobs += [("chat", item.messages) for item in load_workload(source)]
        else:
            path = Path(source).expanduser()
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            jobs += [("text", ids) for ids in D.code_sequences(encode, 10 ** 9, o.window, o.seed, files)]
    per_shard = 8
    shards = math.ceil(len(jobs) / per_shard)
    task = progress.add_task("data", total=len(jobs))
    params = SamplingParams(max_tokens=o.answer_tokens, temperature=0, repetition_penalty=1.1)
    for s in range(shards):
        part = jobs[s * per_shard:(s + 1) * per_shard]
        if (directory / f"shard-{s:04d}.pt").exists():
            progress.advance(task, len(part))
            continue
        seqs = []
        for kind, job in part:
            if kind == "chat":
                prompt = llm.chat_prompt(job)[-o.window:]  # long prompts: their tail (features cost)
                ids, source = prompt + llm.generate(prompt, params).token_ids, "chat"
            else:
                ids, source = job, "text"
            seqs.append(D.featurize(llm, ids, taps, source))
            progress.advance(task)
        D.write_shard(directory, s, seqs)
    log(f"data: {len(jobs)} sequences in {directory}")
    return directory


def windows(shards: list[dict], window: int) -> dict[str, torch.Tensor]:
    """Every sequence cut into windows of `window` tokens, padded (preds -1) -> stacked tensors."""
    ids, taps, preds = [], [], []
    for seq in (s for shard in shards for s in shard):
        for start in range(0, len(seq["ids"]) - 1, window):
            n = min(window, len(seq["ids"]) - start)
            if n < 8:
                continue
            pad = window - n
            ids.append(torch.nn.functional.pad(seq["ids"][start:start + n], (0, pad)))
            preds.append(torch.nn.functional.pad(seq["preds"][start:start + n], (0, pad), value=-1))
            taps.append(torch.nn.functional.pad(seq["taps"][start:start + n], (0, 0, 0, pad)))
    return {"ids": torch.stack(ids), "taps": torch.stack(taps), "preds": torch.stack(preds)}


def draft_vocabulary(data: dict, size: int, vocab: int) -> torch.Tensor:
    """The `size` tokens the target predicted most often (ties and the rest by frequency in the text)."""
    preds = data["preds"][data["preds"] >= 0].long()
    counts = torch.bincount(preds, minlength=vocab).double() * 1e6 + torch.bincount(data["ids"].flatten().long(),
                                                                                    minlength=vocab).double()
    return counts.topk(size).indices.sort().values


@dataclass
class Target:
    """What training needs of the target besides the data: its config and float embedding, final norm, LM head."""
    config: object
    embed_weight: torch.Tensor
    embed_scale: float | None
    norm_weight: torch.Tensor
    lm_head_weight: torch.Tensor

    @classmethod
    def of(cls, model) -> "Target":
        w = lambda t: t.detach().float().clone()  # noqa: E731
        return cls(model.config, w(model.embed_tokens.weight), model.embed_scale, w(model.norm.weight),
                   w(model.lm_head.weight))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(ids, self.embed_weight)
        return x * self.embed_scale if self.embed_scale else x


def train_drafter(o: TrainOptions, progress, log=print) -> dict:
    """Loads the target, makes (or resumes) the data, trains (or resumes) the head and writes it to o.out."""
    from fastdecode import LLM

    t_start = time.perf_counter()
    if o.threads:
        torch.set_num_threads(o.threads)
    o.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(o.model, quant="none", threads=o.threads, max_seq_len=4096)  # float first: the head starts from it
    target = Target.of(llm.model)
    cfg = head_config_for(llm.model, o.kind, o.model, o.draft_vocab, mtp_depth=o.steps)
    if o.quant:  # the data then comes from the target as it will serve (the runner takes the quantized modules)
        from fastdecode.quant import quantize_model
        from fastdecode.runners import build_runner
        quantize_model(llm.model, o.quant)
        llm.quant = o.quant
        llm.runner = llm.engine.runner = build_runner(llm.model, llm.engine.kv)
    directory = make_data(o, llm, cfg.taps, progress, log)
    t_data = time.perf_counter() - t_start
    del llm
    data = windows(D.read_shards(directory), o.window)
    return fit(o, cfg, target, data, progress, log, extra={"data_s": round(t_data, 1)})


def fit(o: TrainOptions, cfg, target: Target, data: dict, progress, log=print, extra: dict | None = None) -> dict:
    """Trains a head of cfg on windows (ids, taps, preds) with a held-out share; checkpoints to o.out and resumes
    from there; writes head.safetensors and config.json -> the training summary."""
    torch.manual_seed(o.seed)
    random.seed(o.seed)
    o.out.mkdir(parents=True, exist_ok=True)
    n_windows = data["ids"].shape[0]
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(o.seed))
    n_val = max(1, int(n_windows * o.holdout))
    val, train = order[:n_val], order[n_val:]
    tokens = int((data["preds"] >= 0).sum())
    log(f"data: {tokens} tokens in {n_windows} windows of {o.window} ({n_val} held out)")

    vocab = target.config.vocab_size
    draft_ids = draft_vocabulary(data, cfg.draft_vocab_size, vocab)
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    head = build_head(cfg)
    init_from_target(head, target.norm_weight, target.lm_head_weight, draft_ids)
    rope = rope_cache(cfg.head_dim, o.window + o.steps + 1, target.config.rope_theta, target.config.rope_scaling)
    forward = eagle_logits if o.kind == "eagle" else mtp_logits

    steps_per_epoch = math.ceil(len(train) / o.batch)
    total_steps = max(1, int(o.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(head.parameters(), lr=o.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = min(20, total_steps // 10 + 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / total_steps))))
    checkpoint, step, train_s = o.out / "checkpoint.pt", 0, 0.0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)  # tensors, numbers and strings only: no pickle
        if options_key(state["options"]) != options_key(o):
            raise ValueError(f"{checkpoint} was written with other settings; remove it or pass another --out")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, train_s = state["step"], state["train_s"]
        log(f"resumed from {checkpoint} at step {step}/{total_steps}")

    def run(idx):
        ids, preds = data["ids"][idx], data["preds"][idx]
        logits = forward(head, target.embed, data["taps"][idx], ids, o.steps, rope)
        return head_loss(logits, step_targets(ids, preds, o.steps), to_draft)

    task = progress.add_task("train", total=total_steps, completed=step)
    loss_avg = first_loss = None
    t0 = time.perf_counter()
    head.train()
    while step < total_steps:
        epoch, i = divmod(step, steps_per_epoch)
        perm = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(o.seed * 1000 + epoch))]
        loss, _ = run(perm[i * o.batch:(i + 1) * o.batch])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        first_loss = loss.item() if loss_avg is None else first_loss
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
        progress.update(task, advance=1, description=f"train (loss {loss_avg:.3f})")
        if step % o.checkpoint_every == 0 or step == total_steps:
            save_checkpoint(checkpoint, head, opt, sched, step, train_s + time.perf_counter() - t0, o)
    train_s += time.perf_counter() - t0

    head.eval()
    with torch.no_grad():
        parts = [run(val[i:i + o.batch])[1] for i in range(0, len(val), o.batch)]
    merged = [(torch.cat([p[k][0].flatten() for p in parts]), torch.cat([p[k][1].flatten() for p in parts]))
              for k in range(len(parts[0]))]
    mean_len, per_step = accepted_length(merged)
    summary = {**(extra or {}), "data_tokens": tokens, "windows": n_windows, "held_out_windows": n_val,
               "train_s": round(train_s, 1), "steps": total_steps, "epochs": o.epochs, "first_loss": first_loss,
               "final_loss": loss_avg,
               "held_out_accepted_length": round(mean_len, 3),
               "held_out_step_accuracy": [round(a, 3) for a in per_step],
               "options": options_key(o)}
    cfg.training = summary
    save_head(head, cfg, o.out)
    log(f"held-out: mean accepted length {mean_len:.2f} over {o.steps} steps, top-1 per step "
        f"{', '.join(f'{a:.2f}' for a in per_step)}; wrote {o.out}")
    return summary


RUN_LOCAL = ("out", "data_dir", "threads", "checkpoint_every")  # a run moved or resumed elsewhere is the same run


def options_key(o: TrainOptions | dict) -> dict:
    """The settings a checkpoint must share to be resumed (of options, or of a checkpoint's stored key)."""
    items = o.items() if isinstance(o, dict) else asdict(o).items()
    return {k: str(v) for k, v in items if k not in RUN_LOCAL}


def save_checkpoint(path: Path, head, opt, sched, step: int, train_s: float, o: TrainOptions):
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                "train_s": train_s, "rng": torch.get_rng_state(), "options": options_key(o)}, tmp)
    tmp.rename(path)
