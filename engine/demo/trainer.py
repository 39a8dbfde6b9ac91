"""Training loops for the demo base model and its LoRA adapters (transformers + PEFT, on CPU)."""

import math
import random
from collections.abc import Callable

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from engine.demo.corpus import Example
from engine.demo.tokenizer import BOS, EOS, PAD, chat_prompt


def llama_config(tokenizer: Tokenizer, *, hidden: int, layers: int, max_positions: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        head_dim=32,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
    )


def encode_batch(tokenizer: Tokenizer, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels that score only the answer and its EOS."""
    pad, eos = tokenizer.token_to_id(PAD), tokenizer.token_to_id(EOS)
    prompts = tokenizer.encode_batch([chat_prompt(e.user) for e in examples], add_special_tokens=False)
    answers = tokenizer.encode_batch([e.assistant for e in examples], add_special_tokens=False)
    rows = [(p.ids, a.ids + [eos]) for p, a in zip(prompts, answers, strict=True)]
    width = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [batch, width]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [batch, width]
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        input_ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def train(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    make_example: Callable[[random.Random], Example],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log: Callable[[str], None],
    on_step: Callable[[], None] | None = None,
) -> float:
    """AdamW with warmup and cosine decay on freshly sampled batches; returns the final loss.
    `on_step` is called after each step (progress reporting; it never touches the model)."""
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        batch = encode_batch(tokenizer, [make_example(rng) for _ in range(batch_size)])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if on_step is not None:
            on_step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:4d}/{steps} loss {loss_value:.4f}")
    model.eval()
    return loss_value


@torch.inference_mode()
def greedy_answers(model: torch.nn.Module, tokenizer: Tokenizer, users: list[str], *, max_new: int = 64) -> list[str]:
    """Greedy chat answers with transformers' generate (the demo's own check)."""
    eos, pad = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    out = []
    for user in users:
        ids = torch.tensor([tokenizer.encode(chat_prompt(user), add_special_tokens=False).ids])
        generated = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
            do_sample=False, eos_token_id=eos, pad_token_id=pad,
        )
        new = [t for t in generated[0, ids.shape[1]:].tolist() if t != eos]
        out.append(tokenizer.decode(new))
    return out


def new_base_model(config: LlamaConfig, *, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
