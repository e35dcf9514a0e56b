"""Names: common naming conventions, how alike two module paths are, a module's kind by its
class name, and globs over the block numbers of repeated blocks."""

from __future__ import annotations

import re
from collections import defaultdict

# Common naming conventions: each line is one meaning; a name token (or a whole name segment)
# on it counts as the same word as any other on it. Add conventions here, never model names.
SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("query", "q", "wq", "q_proj", "to_q", "q_lin"),
    ("key", "k", "wk", "k_proj", "to_k", "k_lin"),
    ("value", "v", "wv", "v_proj", "to_v", "v_lin"),
    ("out", "o", "wo", "o_proj", "out_proj", "to_out", "out_lin", "dense"),
    ("attention", "attn", "self_attn", "selfattention", "att", "self_attention"),
    ("mlp", "ffn", "feed_forward", "feedforward", "ff", "ffwd"),
    ("gate", "w1", "gate_proj", "wi_0", "c_fc"),
    ("up", "w3", "up_proj", "wi_1"),
    ("down", "w2", "down_proj", "c_proj"),
    ("attn_norm", "attention_norm", "input_layernorm", "ln_1", "ln1", "norm1", "attn_ln"),
    ("ffn_norm", "post_attention_layernorm", "ln_2", "ln2", "norm2", "mlp_ln", "ffn_ln"),
    ("final_norm", "ln_f", "norm", "final_layernorm", "final_norm", "norm_f"),
    ("embed", "tok_embeddings", "embed_tokens", "wte", "embedding", "embeddings", "lut",
     "word_embeddings", "tok_emb", "token_embedding"),
    ("position", "wpe", "pos", "position_embeddings", "pos_embed", "pos_emb"),
    ("head", "output", "lm_head", "generator", "unembed"),
    ("layers", "h", "blocks", "layer", "block"),
    ("act", "activation", "act_fn", "gelu", "relu", "silu", "nonlinearity"),
)
_CANON = {word: words[0] for words in SYNONYMS for word in words}

# Module kinds by class name: two calls of different known kinds never pair.
_KINDS = (("dense", r"^(Linear|Conv1D|Dense|.*Linear)$"), ("embedding", r"Embedding"),
          ("norm", r"Norm"), ("dropout", r"Dropout"), ("conv", r"^Conv[123]d$|Conv"),
          ("act", r"GELU|ReLU|SiLU|Tanh|Sigmoid|Activation|Swish|Mish|Softmax"),
          ("attention", r"Attention|Attn"), ("mlp", r"MLP|FeedForward|FFN"),
          ("rotary", r"Rotary|RoPE"))
_LEAF_KINDS = {"dense", "embedding", "norm", "dropout", "conv", "act"}


def module_kind(type_name: str) -> str:
    """What a module class computes, from its name: dense, norm, embedding, ... or other."""
    for kind, pattern in _KINDS:
        if re.search(pattern, type_name):
            return kind
    return "other"



def _tokens(segment: str) -> set[str]:
    if segment in _CANON:
        return {_CANON[segment]}
    words = re.split(r"[_\W]+|(?<=[a-z])(?=[A-Z])", segment)
    return {_CANON.get(w.lower(), w.lower()) for w in words if w and not w.isdigit()}


def name_similarity(reference: str, port: str) -> float:
    """0..1: how alike two module paths' last segments are (with :data:`SYNONYMS`), a little
    for their parents' and for equal block numbers."""
    ref_parts, port_parts = reference.split("."), port.split(".")
    score = _segment_similarity(ref_parts[-1], port_parts[-1])
    if len(ref_parts) > 1 and len(port_parts) > 1:
        score += 0.25 * _segment_similarity(ref_parts[-2], port_parts[-2])
    ref_numbers = [p for p in ref_parts if p.isdigit()]
    if ref_numbers and ref_numbers == [p for p in port_parts if p.isdigit()]:
        score += 0.25
    return min(score, 1.0)


def _segment_similarity(a: str, b: str) -> float:
    if a == b:
        return 1.0
    if a.isdigit() or b.isdigit():
        return 0.0
    ta, tb = _tokens(a), _tokens(b)
    if not ta or not tb:
        return 0.0
    return len(ta & tb) / len(ta | tb)


def _similar_words(reference: str, port: str) -> str:
    return f"name {reference.rsplit('.', 1)[-1]}~{port.rsplit('.', 1)[-1]}"



_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _glob(name: str, keep: int | None = None) -> tuple[str, tuple[str, ...]]:
    """A name with its first ``keep`` block numbers (all by default) made '*', and those
    numbers."""
    numbers = _NUMBER.findall(name)
    keep = len(numbers) if keep is None else min(keep, len(numbers))
    return _NUMBER.sub("*", name, count=keep) if keep else name, tuple(numbers[:keep])


def _shared_numbers(key: str, others: list[str]) -> int:
    """How many leading block numbers ``key`` shares with every other name (layer 3's q with
    block 3's wq: one; a Sequential's own index after it is not a block number)."""
    key_numbers = _NUMBER.findall(key)
    shared = len(key_numbers)
    for other in others:
        numbers = _NUMBER.findall(other)
        n = 0
        while n < min(shared, len(numbers)) and numbers[n] == key_numbers[n]:
            n += 1
        shared = n
    return shared


def _generalise(pairs: list[tuple[str, list[str]]],
                universe: set[str]) -> list[tuple[str, list[str], list[int]]]:
    """(key glob, other globs, indexes of the pairs it covers) for pairs of a key name (the
    side a rule's pattern matches) and the names it gives: a glob over the block numbers both
    sides share, where every name in ``universe`` the key glob matches is one of the pairs."""
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)
    single = []
    for k, (key, others) in enumerate(pairs):
        shared = _shared_numbers(key, others)
        if shared:
            groups[_glob(key, shared)[0], tuple(_glob(o, shared)[0] for o in others)].append(k)
        else:
            single.append(k)
    out = []
    for (key_glob, globs), members in groups.items():
        pattern = _glob_pattern(key_glob)
        instances = {name for name in universe if pattern.match(name)}
        if len(members) > 1 and instances == {pairs[k][0] for k in members}:
            out.append((key_glob, list(globs), members))
        else:
            single += members
    out += [(pairs[k][0], list(pairs[k][1]), [k]) for k in sorted(single)]
    return out


def _glob_pattern_first(glob: str, modules) -> str:
    """The first module a glob names (for ordering rules by call order)."""
    pattern = _glob_pattern(glob)
    return next((m for m in modules if pattern.match(m)), glob)


def _glob_pattern(glob: str) -> re.Pattern:
    return re.compile(re.escape(glob).replace(r"\*", r"\d+") + "$")
