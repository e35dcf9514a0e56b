"""A tiny GPT-2 whose blocks take Hugging Face-style keyword arguments, against a port whose don't.

``tests/gpt_cases.py``'s ``reference`` has Hugging Face GPT-2's layout, but its attention and
blocks take only ``hidden_states`` and return a tensor. Real Hugging Face models do not: in
transformers 4.5x ``GPT2Block`` is called as ``block(hidden_states, past_key_values=None,
cache_position=None, attention_mask=None, head_mask=None, use_cache=False,
output_attentions=False)``, calls its attention by keyword the same way, and both return tuples
(``GPT2Attention`` returns ``(attn_output, attn_weights_or_None)``, ``GPT2Block`` returns
``(hidden_states,)``). A port written nanoGPT's way (``tests.gpt_cases:port`` and its planted
bugs) has blocks that take only the hidden states and return a tensor, so a tool that calls a port
layer with the reference's recorded arguments, or compares outputs by argument path, meets
keyword arguments the port does not accept and outputs of another structure.

``reference_hf`` is that reference: the modules of ``gpt_cases`` with Hugging Face's call
signatures, built in the same order from the same seed, so its parameter names, its numbers and
its loss are those of ``tests.gpt_cases:reference`` and ``tests/gpt_port.map.toml`` maps it to
the ports of ``gpt_cases`` unchanged::

    layerdiff capture tests.hf_cases:reference_hf -o ref.h5 --loss-scale 1048576
    layerdiff replay ref.h5 tests.gpt_cases:port_bug_attn_scale --map tests/gpt_port.map.toml

``python -m tests.hf_cases`` checks that the two references agree (parameters, logits, loss).
"""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case
from tests import gpt_cases as gpt
from tests.gpt_cases import GPTConfig


def _unsupported(**arguments: object) -> None:
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise NotImplementedError(f"this tiny GPT-2 does not support {', '.join(given)}")


class GPT2Attention(gpt.GPT2Attention):
    """``gpt_cases.GPT2Attention`` with transformers 4.5x's call: keywords in, a tuple out."""

    def _attn_weights(self, query: torch.Tensor, key: torch.Tensor,
                      attention_mask: torch.Tensor | None,
                      head_mask: torch.Tensor | None) -> torch.Tensor:
        # gpt_cases.GPT2Attention._attn's arithmetic, with HF's eager additive mask and head mask
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / (self.head_dim ** 0.5)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length]
        attn_weights = attn_weights.masked_fill(~causal_mask,
                                                torch.finfo(attn_weights.dtype).min)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = self.attn_dropout(attn_weights)
        if head_mask is not None:
            attn_weights = attn_weights * head_mask
        return attn_weights

    returns_weights = False  # transformers 5.x's eager attention returns them always

    def forward(self, hidden_states: torch.Tensor, past_key_values=None, cache_position=None,
                attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        _unsupported(past_key_values=past_key_values, encoder_hidden_states=encoder_hidden_states,
                     encoder_attention_mask=encoder_attention_mask)
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = (self._split_heads(x) for x in (query, key, value))
        attn_weights = self._attn_weights(query, key, attention_mask, head_mask)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = self.resid_dropout(self.c_proj(self._merge_heads(attn_output)))
        keep = output_attentions or self.returns_weights
        return attn_output, (attn_weights if keep else None)


class GPT2Block(gpt.GPT2Block):
    """``gpt_cases.GPT2Block`` with transformers 4.5x's call; returns ``(hidden_states,)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        nn.Module.__init__(self)
        # the order of gpt_cases.GPT2Block.__init__, so the same seed draws the same weights
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = gpt.GPT2MLP(cfg)

    def forward(self, hidden_states: torch.Tensor, past_key_values=None, cache_position=None,
                attention_mask: torch.Tensor | None = None,
                head_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                use_cache: bool = False, output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, ...]:
        _unsupported(encoder_hidden_states=encoder_hidden_states,
                     encoder_attention_mask=encoder_attention_mask)
        residual = hidden_states
        attn_output, attn_weights = self.attn(
            self.ln_1(hidden_states), past_key_values=past_key_values,
            cache_position=cache_position, attention_mask=attention_mask, head_mask=head_mask,
            output_attentions=output_attentions)
        hidden_states = residual + attn_output
        residual = hidden_states
        hidden_states = residual + self.mlp(self.ln_2(hidden_states))
        return (hidden_states, attn_weights) if output_attentions else (hidden_states,)


class GPT2Model(gpt.GPT2Model):
    """``gpt_cases.GPT2Model`` calling its blocks as transformers 4.5x does; returns a tuple."""

    block_class = GPT2Block

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor]:
        if attention_mask is not None:
            # (batch, seq) of 1 = attend, 0 = padding -> additive (batch, 1, 1, seq), as HF's eager
            attention_mask = attention_mask[:, None, None, :].to(self.wte.weight.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(attention_mask.dtype).min
        position_ids = torch.arange(input_ids.size(-1), device=input_ids.device)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states, past_key_values=None, cache_position=None,
                                  attention_mask=attention_mask, head_mask=None,
                                  use_cache=False, output_attentions=False)[0]
        return (self.ln_f(hidden_states),)  # return_dict=False


class GPT2LMHeadModel(gpt.GPT2LMHeadModel):
    model_class = GPT2Model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor]:
        hidden_states = self.transformer(input_ids, attention_mask=attention_mask)[0]
        return (self.lm_head(hidden_states),)  # return_dict=False


# ---- cases
def reference_hf() -> Case:
    """``tests.gpt_cases:reference`` with Hugging Face's block and attention call signatures."""
    return gpt._build(GPT2LMHeadModel, "tests.hf_cases:reference_hf")


def reference_hf_weights() -> Case:
    """As :func:`reference_hf`, with attentions that return their weights as a second tensor
    whether asked or not, as transformers 5.x's eager attention does (its block takes [0])."""
    case = gpt._build(GPT2LMHeadModel, "tests.hf_cases:reference_hf_weights")
    for block in case.model.transformer.h:
        block.attn.returns_weights = True
    return case


def _check_same_as_gpt_cases() -> None:
    """The numbers are ``gpt_cases.reference``'s: same parameters, logits, loss and gradients."""
    plain, hf = gpt.reference(), reference_hf()
    plain_params = dict(plain.model.named_parameters())
    hf_params = dict(hf.model.named_parameters())
    assert plain_params.keys() == hf_params.keys(), (plain_params.keys(), hf_params.keys())
    for name, param in plain_params.items():
        assert torch.equal(param, hf_params[name]), name
    plain_out, hf_out = plain.model(*plain.inputs), hf.model(*hf.inputs)
    assert torch.equal(plain_out[0], hf_out[0])
    plain_loss, hf_loss = plain.loss_fn(plain_out), hf.loss_fn(hf_out)
    assert torch.equal(plain_loss, hf_loss), (plain_loss, hf_loss)
    plain_loss.backward()
    hf_loss.backward()
    for name, param in plain_params.items():
        assert torch.equal(param.grad, hf_params[name].grad), name
    # an all-ones attention mask (no padding) changes nothing
    masked = hf.model(hf.inputs[0], attention_mask=torch.ones_like(hf.inputs[0]))
    assert torch.allclose(masked[0], hf_out[0], rtol=0, atol=1e-6)
    print(f"tests.hf_cases:reference_hf == tests.gpt_cases:reference: loss {hf_loss.item():.9f}")


if __name__ == "__main__":
    _check_same_as_gpt_cases()
