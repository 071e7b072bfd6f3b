"""The one interface every checkpoint format implements (``Format``), and the helpers the formats share.

A format is a subclass of ``Format``: defining it registers it (``__init_subclass__``), so adding a
format is one module in this package, which ``quantkit.formats`` imports without a list of them.
The base class's defaults fit the common case (a uniform grid, each linear stored on its own, read
by quantkit alone); a format overrides only what it does differently."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import Tensor

from quantkit.formats.consumers import QUANTKIT, Consumer
from quantkit.quant import QuantConfig, QuantizedTensor
from quantkit.recipes.fields import Section

if TYPE_CHECKING:  # the config class imports transformers: annotations only
    from quantkit.models import MiniCPMConfig

Shapes = Mapping[str, tuple[int, int]]  # linear name -> (out_features, in_features)

_REGISTERED: list[Format] = []


def registered() -> list[Format]:
    """Every format defined so far, in the order defined."""
    return list(_REGISTERED)


def tensor_key(prefix: str, name: str) -> str:
    """The name of tensor ``name`` ("qweight") of the module named ``prefix`` ("model.layers.0.mlp.up_proj")."""
    if prefix.endswith("."):
        raise ValueError(f"prefix is a module name without a trailing dot, got {prefix!r}")
    return f"{prefix}.{name}" if prefix else name


def fetch_packed(tensors: Mapping[str, Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...],
                 kind: str) -> Tensor:
    """``tensors[key]``, which a ``kind`` (Marlin, AWQ) checkpoint stores as ``dtype`` of ``shape``."""
    if key not in tensors:
        raise KeyError(f"{kind} tensor {key!r} is missing")
    tensor = tensors[key]
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"{kind} tensor {key!r} must be {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor


class Format:
    """A checkpoint format: converts ``QuantizedTensor`` records to tensors and back, and says who reads it.

    A subclass is registered when it is defined, once per ``variants()`` (one instance by default; a
    family such as GGUF's file types gives several); ``abstract=True`` in the class statement marks a
    base for other formats, which is not registered itself."""

    name: str
    summary: str
    # names a quantized linear's tensors end with ("qweight", ...), or their prefix (see ``stores``)
    suffixes: tuple[str, ...]
    # where the format stands in listings (the recipe's choices, docs/recipes.md's table): lowest first
    list_order: int
    # (quant_method, checkpoint_format or None) of checkpoints other tools write that this format reads
    reads: tuple[tuple[str | None, str | None], ...] = ()
    weights_file: str | None = None  # a single weights file the consumer insists on (else sharded + index)
    block_types = False  # linears are solved on GGUF block types, not on the recipe's uniform grid
    # the format an EAGLE-3 draft head's fc is written in when the head is written in this one (the
    # official layout, models/eagle3.py), or None: this format holds no draft head
    draft_head_fc: str | None = None
    # the programs that read it, as a model card shows them; the first with a ``library`` names the
    # Hub's library_name
    consumers: tuple[Consumer, ...] = (QUANTKIT,)
    # the kernel layout each linear's stored tensors (``linear_tensors``) already are, for kernels that
    # run them with no repacking at load (kernels/linear); None: the runtime works from the records
    stored_layout: str | None = None
    # the recipe section of its own settings, named as the format; absent from recipes that do not state it
    settings: Section | None = None
    # the embedding, final norm and LM head as stored, for formats that quantize some of them too:
    # (tensors, grid) -> what is written, and (stored tensors, grid) -> the float tensors they mean
    write_outside = None
    read_outside = None

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        for fmt in cls.variants():
            if any(other.name == fmt.name for other in _REGISTERED):
                raise ValueError(f"format {fmt.name!r} is defined twice")
            _REGISTERED.append(fmt)

    @classmethod
    def variants(cls) -> tuple[Format, ...]:
        return (cls(),)

    def __repr__(self) -> str:
        return f"<format {self.name}>"

    def check(self, config: QuantConfig, in_features: int, out_features: int, desc_act: bool, name: str) -> None:
        """Raise a ValueError naming linear ``name`` if the format cannot store it on ``config``; run
        before quantization starts."""
        raise NotImplementedError

    def write_linear(self, record: QuantizedTensor, module: str) -> dict[str, Tensor]:
        """The tensors of one linear (``module``: its name, "model.layers.0.mlp.up_proj")."""
        raise NotImplementedError

    def read_linear(self, tensors: Mapping[str, Tensor], module: str, config: QuantConfig,
                    shape: tuple[int, int]) -> QuantizedTensor:
        """Exact inverse of ``write_linear`` for a linear of ``shape`` (N, K)."""
        raise NotImplementedError

    def write_layer(self, records: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
        """A decoder layer's tensors from its linears' records (``prefix``: "model.layers.i.")."""
        return {key: tensor for linear, record in records.items()
                for key, tensor in self.write_linear(record, prefix + linear).items()}

    def read_layer(self, tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig,
                   shapes: Shapes) -> dict[str, QuantizedTensor]:
        """Exact inverse of ``write_layer``: each linear of ``shapes`` -> its record."""
        return {linear: self.read_linear(tensors, prefix + linear, config, shape) for linear, shape in shapes.items()}

    def linear_tensors(self, tensors: Mapping[str, Tensor], module: str) -> dict[str, Tensor]:
        """One linear's stored tensors by suffix ("qweight" -> ...), as its ``stored_layout`` kernel takes them."""
        return {suffix: tensors[tensor_key(module, suffix)] for suffix in self.suffixes}

    def quantization_config(self, config: QuantConfig, **settings: Any) -> dict[str, Any]:
        """``config.json["quantization_config"]`` as the consumers read it. ``settings``: what the algorithm
        records (``Algorithm.recorded_settings``: desc_act, static_groups, damp_percent) and ``quantizer``."""
        raise NotImplementedError

    def parse_config(self, quantization_config: Mapping[str, Any]) -> QuantConfig:
        """Inverse of ``quantization_config``."""
        raise NotImplementedError

    def grid(self, quant: Mapping[str, Any], model_dtype: torch.dtype) -> QuantConfig:
        """The grid of the whole run, from the recipe's quant section and the checkpoint's float dtype."""
        return QuantConfig(**quant)

    def resolve(self, config: QuantConfig, recipe: Mapping[str, Any], layers: int) -> QuantConfig:
        """The run grid with every module's own grid, for formats that store modules on different grids
        (MLX's mixed precision); ``target`` then reads it per linear."""
        return config

    def target(self, config: QuantConfig, linear: str, layer: int, model: MiniCPMConfig,
               shape: tuple[int, int]) -> Any:
        """What the algorithm rounds ``linear`` of decoder layer ``layer`` of ``model`` (weight ``shape``
        (N, K)) to so that this format stores it unambiguously."""
        return config

    def solved_on(self, values: Mapping[str, Any]) -> str | None:
        """What a recipe's linears are solved on when it is not the uniform grid of its quant section (GGUF
        block types, FP8), for naming it when an algorithm cannot: only algorithms that
        ``solves_block_types`` solve on those; or None."""
        return None

    def untrainable(self, values: Mapping[str, Any]) -> str | None:
        """Why block reconstruction (``quantkit.algorithms.reconstruct``) cannot train a recipe's linears in this
        format, or None: by default it trains the uniform grid alone."""
        solved_on = self.solved_on(values)
        return None if solved_on is None else f"format '{self.name}' is solved on {solved_on.split(',')[0]}"

    def activation_grid(self, config: QuantConfig) -> Any:
        """How a serving kernel quantizes each quantized linear's input on this grid (an
        ``activation_quant.ActivationGrid``), or None: the activations stay in 16 bits."""
        return None

    def activation_tensors(self, config: QuantConfig, input_abs_max: Mapping[str, Tensor], prefix: str
                           ) -> dict[str, Tensor]:
        """A static activation scheme's stored scales for a decoder layer (``prefix``: "model.layers.i."),
        from each quantized linear's calibration inputs' max |x| per channel; {} otherwise."""
        return {}

    def kv_cache_grid(self, config: QuantConfig) -> Any:
        """How the server quantizes the KV cache with this artifact's stored scales (an
        ``activation_quant.ActivationGrid``, one static scale per layer for keys and one for values), or
        None: the artifact states none."""
        return None

    def kv_cache_tensors(self, config: QuantConfig, key_abs_max: Tensor, value_abs_max: Tensor, prefix: str
                         ) -> dict[str, Tensor]:
        """A decoder layer's stored KV-cache scales (``prefix``: "model.layers.i.") from the calibration
        keys' (after RoPE) and values' max |x|; {} where ``kv_cache_grid`` is None."""
        return {}

    def config_files(self, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The full config.json -> every JSON file the consumers read it from ({"config.json": ...} at least)."""
        return {"config.json": config}

    def recipe_refusal(self, values: Mapping[str, Any]) -> str | None:
        """Why a recipe writing this format, or stating its own section (``settings``), cannot be used, or None."""
        return None

    def stores(self, tensor_name: str) -> bool:
        """Whether ``tensor_name`` is part of a quantized linear in this format. A dotted suffix
        ("q_proj.weight") matches the name's tail, a plain one its last component, one ending in "_"
        a prefix of that component."""
        suffix = tensor_name.rsplit(".", 1)[-1]
        return any(tensor_name.endswith("." + s) if "." in s
                   else suffix == s or (s.endswith("_") and suffix.startswith(s)) for s in self.suffixes)
