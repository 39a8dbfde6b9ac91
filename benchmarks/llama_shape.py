"""Random Llama checkpoints and LoRA adapters of a given shape, the request trace, and byte counts.

Used by benchmarks/gpu_trace.py. Everything is random: no weights are downloaded. The checkpoint is a
Hugging Face folder (config.json + sharded safetensors) that both the engine and transformers load;
each adapter is an `adapters.LoadedAdapter` saved in Quilt's canonical form, which is also a PEFT
folder, so PEFT loads the very same files.
"""

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch

import adapters

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_position: int
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def in_out(self, module: str) -> tuple[int, int]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden),
        }[module]  # fmt: skip

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab, "max_position_embeddings": self.max_position, "rope_theta": self.rope_theta,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
        }  # fmt: skip


LLAMA3_8B = Shape("llama-3-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                  max_position=8192)  # fmt: skip
TINY = Shape("tiny", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=512, max_position=512)


def weight_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, in Hugging Face Llama naming."""
    names = {"model.embed_tokens.weight": (shape.vocab, shape.hidden)}
    for i in range(shape.layers):
        for module in PROJECTIONS:
            parent = "self_attn" if module in PROJECTIONS[:4] else "mlp"
            in_features, out_features = shape.in_out(module)
            names[f"model.layers.{i}.{parent}.{module}.weight"] = (out_features, in_features)
        names[f"model.layers.{i}.input_layernorm.weight"] = (shape.hidden,)
        names[f"model.layers.{i}.post_attention_layernorm.weight"] = (shape.hidden,)
    names["model.norm.weight"] = (shape.hidden,)
    names["lm_head.weight"] = (shape.vocab, shape.hidden)
    return names


def _random(size, *, std: float, dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(size, device=device, dtype=torch.float32, generator=generator) * std).to(dtype).cpu()


def write_checkpoint(
    directory: Path,
    shape: Shape,
    *,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
) -> dict:
    """Random weights (normal, std 0.02; norms near 1) drawn on `device`, saved in shards while the next
    shard is drawn. Returns bytes written and seconds taken."""
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    generator = torch.Generator(device=device).manual_seed(seed)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    sizes = weight_shapes(shape)
    shards: list[list[str]] = [[]]
    shard_size = 0
    for name, size in sizes.items():
        if shards[-1] and (shard_size + math.prod(size)) * itemsize > shard_bytes:
            shards.append([])
            shard_size = 0
        shards[-1].append(name)
        shard_size += math.prod(size)
    weight_map, total = {}, 0
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for index, names in enumerate(shards):
            file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name in names:
                if name.endswith("norm.weight"):
                    tensors[name] = (1.0 + _random(sizes[name], std=0.05, dtype=torch.float32, device=device,
                                                   generator=generator)).to(dtype)  # fmt: skip
                else:
                    tensors[name] = _random(
                        sizes[name], std=0.02, dtype=dtype, device=device, generator=generator
                    )
                weight_map[name] = file
                total += tensors[name].numel() * itemsize
            if pending is not None:
                pending.result()
            pending = writer.submit(
                safetensors.torch.save_file, tensors, str(directory / file), {"format": "pt"}
            )
        if pending is not None:
            pending.result()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {**shape.hf_config(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return {"bytes": total, "seconds": time.perf_counter() - start, "shards": len(shards)}


def build_adapter(
    shape: Shape, *, rank: int, seed: int, dtype: torch.dtype, device: str, alpha: float = 32.0
) -> "adapters.LoadedAdapter":
    """A rank-`rank` adapter on all seven projections of every layer, random A and B (B non-zero)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors, ranks, alphas, scaling = {}, {}, {}, {}
    for layer in range(shape.layers):
        for module in PROJECTIONS:
            key = f"layers.{layer}.{module}"
            in_features, out_features = shape.in_out(module)
            tensors[f"{key}.lora_A"] = _random((rank, in_features), std=in_features**-0.5, dtype=dtype,
                                               device=device, generator=generator)  # fmt: skip
            tensors[f"{key}.lora_B"] = _random((out_features, rank), std=0.02, dtype=dtype, device=device,
                                               generator=generator)  # fmt: skip
            ranks[key], alphas[key], scaling[key] = rank, alpha, alpha / rank
    return adapters.LoadedAdapter.build(
        tensors=tensors, ranks=ranks, alphas=alphas, scaling=scaling, alpha=alpha, use_rslora=False,
        base_model_name_or_path=f"random-{shape.name}",
    )  # fmt: skip


def write_adapters(
    root: Path, shape: Shape, ids: list[int], *, rank: int, dtype: torch.dtype, device: str, workers: int = 4
) -> tuple[dict[int, tuple[str, str]], float]:
    """Adapter `i` (seeded by i) written to root/adapter-i; returns {i: (path, digest)} and seconds taken."""
    start = time.perf_counter()

    def one(i: int) -> tuple[int, tuple[str, str]]:
        adapter = build_adapter(shape, rank=rank, seed=1000 + i, dtype=dtype, device=device)
        path = adapter.save(root / f"adapter-{i}")
        return i, (str(path), adapter.digest)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        written = dict(pool.map(one, ids))
    return written, time.perf_counter() - start


def adapter_bytes(shape: Shape, rank: int, itemsize: int) -> int:
    """Bytes of one adapter of rank `rank` on all seven projections: every A and B row, every layer."""
    return shape.layers * rank * sum(sum(shape.in_out(m)) for m in PROJECTIONS) * itemsize


def weight_bytes_per_decode_step(shape: Shape, batch: int, itemsize: int) -> int:
    """Base weights a decode step must read: every matrix and norm once, and `batch` embedding rows."""
    total = 0
    for name, size in weight_shapes(shape).items():
        total += batch * shape.hidden if name == "model.embed_tokens.weight" else math.prod(size)
    return total * itemsize


def kv_bytes_per_decode_step(shape: Shape, contexts: list[int], itemsize: int) -> int:
    """KV cache bytes a decode step moves: each sequence's keys and values read, the new token's written."""
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * itemsize
    return per_token * (sum(contexts) + len(contexts))


@dataclass
class Request:
    index: int
    adapter: int  # population id, drawn from the power law
    prompt: list[int]
    max_tokens: int


def make_trace(
    count: int,
    *,
    population: int,
    zipf: float,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int,
    seed: int = 0,
) -> list[Request]:
    """`count` requests: adapter i of `population` with probability proportional to 1 / (i + 1) ** zipf,
    prompt and output lengths uniform in their ranges, random prompt tokens."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf for i in range(population)]
    chosen = rng.choices(range(population), weights=weights, k=count)
    return [
        Request(i, chosen[i], [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))],
                rng.randint(*output_range))
        for i in range(count)
    ]  # fmt: skip


def trace_to_json(trace: list[Request]) -> list[dict]:
    return [asdict(r) for r in trace]


def trace_from_json(rows: list[dict]) -> list[Request]:
    return [Request(**row) for row in rows]
