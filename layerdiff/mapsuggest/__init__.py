"""``suggest_mapping``: a first draft of a mapping file, from a reference trace and a port case.

``suggest_mapping("ref.h5", port_case)`` pairs the port's module calls and tensors with the
reference's and writes the pairs as a mapping (TOML that :meth:`Mapping.load` reads), every
rule commented with the evidence it stands on and the doubtful ones marked ``# UNSURE:``.

The evidence, strongest first:

1. **Values.** The draft's weights are loaded into the port (on a copy of its state, put back
   afterwards) and the port runs the case's forward once: a port call whose output equals the
   reference's recorded output at its paired site confirms the pair, and inputs that equal the
   reference's arguments by value say which argument is which (``args`` rules).
2. **Type and shapes.** A module's class name and kind (dense: ``nn.Linear`` and Hugging Face's
   ``Conv1D``, which stores its weight transposed; norms; embeddings; ...), the shapes of its own
   parameters (as they are, or transposed), and the shape of its output.
3. **Execution order.** Both call sequences (the reference's recorded sites; the port's, seen by
   wrapping every module's ``forward`` while its case runs once, so a module called as
   ``child.forward(...)`` is seen too) are aligned so that pairs keep their order.
4. **Call structure.** A call that holds no parameters pairs with the port call that holds the
   partners of its children; pairs inside repeated blocks become one glob rule only where every
   instance agrees.
5. **Names.** Tokens of the module names, with a small table of common naming conventions
   (:data:`SYNONYMS`: ``wq``~``q_proj``, ``w1``~``gate_proj``, ``attention_norm``~
   ``input_layernorm``, ``tok_embeddings``~``embed_tokens``, ``output``~``lm_head`` ...).

Port tensors that no module pair gives get a ``[[param]]`` rule: a reference tensor of the same
shape (or transposed) left over under the paired module, several stacked along axis 0 in call
order (a fused projection in the port: ``concat``), or one cut into equal parts (a fused
projection in the reference: ``split``). A square weight is transposed where the two dense
layers keep their weights the other way round.

Modules: ``names`` (conventions, similarity, globs), ``calls`` (what each side did),
``pairing`` (calls paired), ``tensors`` (port tensors' sources), ``values`` (values as
evidence), ``draft`` (the drafting and its text), ``result`` (the draft as data).
"""

from __future__ import annotations

from layerdiff.mapsuggest.draft import suggest_mapping
from layerdiff.mapsuggest.names import SYNONYMS, module_kind, name_similarity
from layerdiff.mapsuggest.result import MapSuggestion, Suggestion

__all__ = [
           "SYNONYMS",
           "MapSuggestion",
           "Suggestion",
           "module_kind",
           "name_similarity",
           "suggest_mapping",
]
