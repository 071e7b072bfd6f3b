"""A checkpoint's tokenizer, as transformers loads it, or one clear error naming the directory.

No torch here: the runtime loads its tokenizer in a process of its own while it imports torch
(``quantkit.kernels.tokenizer_process``)."""
from __future__ import annotations

from pathlib import Path

from quantkit.errors import CheckpointError
from quantkit.json_files import read_json_object

# tokenizer_config.json's names for a tokenizer with no code of its own: AutoTokenizer loads those files as
# TokenizersBackend whatever the model, so they are loaded directly, which spares importing AutoTokenizer
# (it imports transformers' Auto model registry, and so quantkit's registration, the model classes and
# their modeling code: about 2 s of the runtime's first answer).
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(directory: str | Path):
    """The checkpoint's tokenizer as transformers' AutoTokenizer loads it, or one clear error naming the
    directory: a missing or malformed tokenizer file otherwise fails deep inside transformers."""
    try:
        settings = read_json_object(Path(directory) / "tokenizer_config.json")
    except CheckpointError:
        settings = {}  # AutoTokenizer reports it, in its own words
    generic = (settings.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in settings
               and (Path(directory) / "tokenizer.json").is_file())
    try:
        if generic:
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(directory))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers and tokenizers raise many kinds for a broken tokenizer
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{directory}: its tokenizer cannot be loaded ({type(e).__name__}: {reason}); a "
                              "checkpoint needs tokenizer.json (or the files of a slow tokenizer) and "
                              "tokenizer_config.json") from e
