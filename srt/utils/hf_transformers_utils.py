"""Loading a Hugging Face tokenizer from a local directory, with errors that name the fix.

transformers 5 quietly falls back to a generic backend when `tokenizer_config.json` names a class it
does not know; a serving runtime must not guess, so such a class is refused here by name.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

TRUST_REMOTE_CODE_HINT = (
    "Failed to load the tokenizer. If the tokenizer is a custom tokenizer not yet available in the "
    "HuggingFace transformers library, consider setting trust_remote_code=True in LLM or using the "
    "--trust-remote-code flag in the CLI."
)
# Any of these beside the model means there is something for AutoTokenizer to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")
# Phrases of transformers errors that mean "this tokenizer class needs code we do not have".
_CUSTOM_CODE_PHRASES = (
    "does not exist or is not currently imported",
    "trust_remote_code",
    "custom code",
    "not found. The tokenizer may need to be converted",
)


class TokenizerLoadError(RuntimeError):
    """The tokenizer cannot be loaded; the message says why and which flag or file fixes it."""


def get_tokenizer(path: str, trust_remote_code: bool = False, **kwargs: Any):
    """Load the tokenizer in `path` (a local model or tokenizer directory) without network access.

    Raises `FileNotFoundError` when the directory or its tokenizer files are missing, and
    `TokenizerLoadError` (a `RuntimeError` starting with SGLang's "Failed to load the tokenizer." text and naming
    `--trust-remote-code` and the original error) when the tokenizer class is unknown or custom.
    """
    _check_local_dir(path)
    _check_declared_class(path, trust_remote_code)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs)
    except (ValueError, OSError, ImportError, KeyError, AttributeError) as exc:
        if any(p in str(exc) for p in _CUSTOM_CODE_PHRASES):
            raise TokenizerLoadError(f"{TRUST_REMOTE_CODE_HINT} Original error: {type(exc).__name__}: {exc}") from exc
        raise TokenizerLoadError(f"Failed to load the tokenizer from {path}: {type(exc).__name__}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", True):
        logger.warning("Using a slow tokenizer (%s); tokenization may be a bottleneck.", type(tokenizer).__name__)
    return tokenizer


def _check_local_dir(path: str) -> None:
    """A missing path must not reach transformers, which would report it as a bad hub repo id."""
    if not path:
        raise FileNotFoundError("No tokenizer path given: pass --model-path (or --tokenizer-path).")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"Tokenizer path {path!r} does not exist. Pass --tokenizer-path (or --model-path) pointing at a "
            f"local model directory that holds tokenizer.json or tokenizer_config.json.")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Tokenizer path {path!r} is not a directory; pass the model directory instead.")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"Tokenizer path {path!r} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}). "
            f"Pass --tokenizer-path pointing at a directory that has them.")


def _check_declared_class(path: str, trust_remote_code: bool) -> None:
    """Refuse a `tokenizer_class` transformers does not define, unless trusted custom code provides it."""
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    name = config.get("tokenizer_class")
    if not isinstance(name, str) or not name:
        return
    if trust_remote_code and config.get("auto_map"):
        return  # the class comes from the model directory's own code
    if _known_tokenizer_class(name):
        return
    reason = ("it is provided by custom code in the model directory (auto_map)" if config.get("auto_map")
              else "transformers does not define it")
    raise TokenizerLoadError(
        f"{TRUST_REMOTE_CODE_HINT} Original error: tokenizer_class {name!r} in "
        f"{os.path.join(path, 'tokenizer_config.json')} cannot be loaded: {reason}. "
        f"Upgrade transformers if the class is new, or fix tokenizer_class.")


def _known_tokenizer_class(name: str) -> bool:
    try:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    except ImportError:  # layout changed: fall back to the public namespace
        import transformers

        return any(hasattr(transformers, n) for n in (name, name.removesuffix("Fast")))
    return any(tokenizer_class_from_name(n) is not None for n in (name, name + "Fast"))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"Failed to load the tokenizer: cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}

