"""The glm5_next (GLM-5.3-Flash architecture) text model on megatron-core.

Public entry points (import from the submodules; importing this package loads nothing heavy):

* :mod:`model.config` -- ``preset(name)``, ``from_hf``/``to_hf``, ``hf_config_dict``, ``parameter_count``.
* :mod:`model.glm5_next` -- ``build_model(cfg)``, ``Glm5NextModel`` (``forward(input_ids, labels)`` gives
  per-token NLL, chunked over the vocabulary head), ``layer_spec``.
* :mod:`model.logprobs` -- ``token_logprobs(model, input_ids)``: forward-only log-prob of each actual
  next token.
* :mod:`model.convert` -- HF <-> Megatron weights (``hf_to_megatron``, ``megatron_to_hf``), the
  in-memory HF-named ``hf_state_dict(model)``, ``save_hf_checkpoint``/``load_hf_checkpoint``.
* :mod:`model.cpu_compat` -- megatron's CUDA-only calls mapped to CPU/gloo when no GPU is present.
"""

import warnings

# On import, megatron-core announces the local fallbacks it takes without TransformerEngine and
# Apex. CPU installs leave both out by design (DESIGN.md), so these say nothing actionable and
# would bury every stage's output; GPU images have both and never print them.
for _expected in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
):
    warnings.filterwarnings("ignore", message=_expected)
