"""Check the ``config.json`` fields that planning reads, before anything uses them.

Source of the fields: the Hugging Face ``config.json`` of each supported family (Mixtral,
Qwen2/Qwen3-MoE, DeepSeek-V3) and the DeepSeek-V4 release's ``config.json``. Two stages:

- :func:`config_problems` (run by :func:`~shardsmith.checkpoint.open_checkpoint` on every
  checkpoint): every field of :data:`INT_FIELDS` that is present has its type and range (``null``
  counts as absent, as transformers writes unset fields: DeepSeek-V3-Lite's ``q_lora_rank``);
  ``architectures`` is a non-empty list of strings; ``num_key_value_heads`` and ``o_groups`` divide
  ``num_attention_heads``; ``quantization_config.weight_block_size`` is two positive integers.
- :func:`config_int` (called by the plan builders where they read a field): the field is present
  when the family needs it, naming the architecture that needs it.

A count is a JSON integer: ``true``, ``4.0``, ``NaN``, ``"4"`` or ``[4]`` are refused, as are values
of :data:`MAX_INT` or more (no real model has 2**31 heads, layers or vocabulary rows).
"""

from __future__ import annotations

from ..errors import SourceError

CONFIG = "config.json"
MAX_INT = 1 << 31

# field -> smallest allowed value; a field absent from the config is not checked here
INT_FIELDS: dict[str, int] = {
    **dict.fromkeys((
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_hidden_layers",
        "num_local_experts", "num_experts", "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "n_routed_experts",
        "o_groups", "o_lora_rank",
    ), 1),
    "num_nextn_predict_layers": 0,
}


def _int_rule(minimum: int) -> str:
    return f"must be an integer >= {minimum} and < 2**31"


def _bad_int(value: object, minimum: int) -> bool:
    return type(value) is not int or not minimum <= value < MAX_INT  # type(): bool is not a count


def config_problems(config: dict) -> list[str]:
    """Every type or range problem of the plan fields present in ``config`` (parsed ``config.json``).

    Returns:
        one line per problem naming ``config.json``, the field, its value and the rule; empty when
        the fields present are well formed (missing fields are the plan builders' concern).
    """
    problems: list[str] = []
    if config.get("architectures") is not None:  # null means absent, as transformers writes it
        archs = config["architectures"]
        if not (isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)):
            problems.append(f"{CONFIG}: architectures is {archs!r}; it must be a non-empty list of non-empty strings "
                            f"such as [\"MixtralForCausalLM\"]")
    if config.get("model_type") is not None and not isinstance(config["model_type"], str):
        problems.append(f"{CONFIG}: model_type is {config['model_type']!r}; it must be a string such as \"mixtral\"")
    for key, minimum in INT_FIELDS.items():
        if config.get(key) is not None and _bad_int(config[key], minimum):
            problems.append(f"{CONFIG}: {key} is {config[key]!r}; it {_int_rule(minimum)}")
    heads = config.get("num_attention_heads")
    if not _bad_int(heads, 1):
        for key in ("num_key_value_heads", "o_groups"):
            n = config.get(key)
            if not _bad_int(n, 1) and heads % n:
                problems.append(f"{CONFIG}: {key} is {n}, which does not divide num_attention_heads={heads} "
                                f"(every {'KV head' if key.startswith('num') else 'output group'} serves a whole "
                                f"number of query heads)")
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            problems.append(f"{CONFIG}: quantization_config is {qc!r}; it must be a JSON object")
        elif qc.get("weight_block_size") is not None:
            block = qc["weight_block_size"]
            if not (isinstance(block, list) and len(block) == 2 and not any(_bad_int(b, 1) for b in block)):
                problems.append(f"{CONFIG}: quantization_config.weight_block_size is {block!r}; it must be two "
                                f"integers >= 1 (rows, columns), such as [128, 128]")
    return problems


def arch_name(config: dict) -> str:
    """The architecture ``config`` names (``architectures[0]``, else ``model_type``), for messages."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return str(config.get("model_type", "this architecture"))


def config_int(config: dict, key: str, *, default: int | None = None) -> int:
    """``config[key]`` as a checked count, or ``default`` when absent (or null) and a default is given.

    Raises:
        SourceError: the field is missing without a default, or not an integer in range, naming
            ``config.json``, the field, the value, the rule and (when missing) the architecture.
    """
    value = config.get(key)
    minimum = INT_FIELDS.get(key, 1)
    if value is None:
        if default is not None:
            return default
        raise SourceError(f"{CONFIG}: field {key} is {'null' if key in config else 'missing'}; "
                          f"{arch_name(config)} checkpoints need it "
                          f"(an integer >= {minimum}) to plan the split")
    if _bad_int(value, minimum):
        raise SourceError(f"{CONFIG}: {key} is {value!r}; it {_int_rule(minimum)}")
    return value


def check_config(config: dict) -> None:
    """Raise on the problems :func:`config_problems` finds.

    Raises:
        SourceError: listing every problem, sorted.
    """
    from ..errors import format_problems

    problems = config_problems(config)
    if problems:
        raise SourceError(format_problems(f"invalid {CONFIG}", problems), sorted(problems))
