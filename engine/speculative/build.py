"""The engine's speculator from its configuration (None when speculation is off)."""

import json
from pathlib import Path

from engine.config import EngineConfig
from engine.models import load_model, read_hf_config, read_spec
from engine.paged_memory import PagedMemory
from engine.speculative.draft import DraftProposer
from engine.speculative.ngram import NgramProposer
from engine.speculative.policy import SpeculationPolicy
from engine.speculative.speculator import Speculator


def _tokenizer_vocab(model_dir: Path) -> dict | None:
    path = model_dir / "tokenizer.json"
    return json.loads(path.read_text()).get("model", {}).get("vocab") if path.exists() else None


def draft_memory_bytes(config: EngineConfig, itemsize: int) -> tuple[int, int]:
    """(bytes per page of the draft's KV, bytes of its weights on disk) to size the pool with (0, 0: no draft)."""
    if config.speculative_method != "draft":
        return 0, 0
    draft_dir = Path(config.speculative_model)
    args = read_spec(read_hf_config(draft_dir))
    page = PagedMemory.bytes_per_page(num_layers=args.num_layers, block_size=config.block_size,
                                      kv_heads=args.num_kv_heads, head_dim=args.head_dim, itemsize=itemsize)
    return page, sum(f.stat().st_size for f in draft_dir.glob("*.safetensors"))


def build_speculator(config: EngineConfig, *, runner, num_pages: int, max_model_len: int) -> Speculator | None:
    if config.speculative_method is None:
        return None
    policy = SpeculationPolicy(num_tokens=config.num_speculative_tokens, max_batch=config.speculative_max_batch,
                               min_acceptance=config.speculative_min_acceptance, max_model_len=max_model_len)
    if config.speculative_method == "ngram":
        return Speculator(proposer=NgramProposer(), policy=policy)
    target = runner.model
    draft_dir = Path(config.speculative_model)
    draft = load_model(draft_dir, dtype=target.lm_head.weight.dtype, device=target.lm_head.weight.device)
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.spec.vocab_size} tokens) differs from the model's "
                         f"({target.spec.vocab_size}): a draft must share the model's tokenizer")
    if _tokenizer_vocab(draft_dir) != _tokenizer_vocab(Path(config.model)):
        raise ValueError("the draft model's tokenizer.json differs from the model's: a draft must share its tokenizer")
    if draft.spec.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model supports {draft.spec.max_position_embeddings} positions, fewer than "
                         f"max_model_len {max_model_len}; lower max_model_len")
    proposer = DraftProposer(model=draft, num_pages=num_pages, block_size=config.block_size, runner=runner)
    return Speculator(proposer=proposer, policy=policy)
