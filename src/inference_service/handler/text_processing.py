"""Text cleanup, tokenisation, n-grams and vocabularies: TorchServe's ``TextHandler`` steps without torchtext."""

from __future__ import annotations

import json
import os
import pickle
import re
import string
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

UNKNOWN_TOKEN = "<unk>"

# Common English contractions (lower case) and their expansions.
CONTRACTIONS: dict[str, str] = {
    "ain't": "is not", "aren't": "are not", "can't": "cannot", "can't've": "cannot have",
    "'cause": "because", "could've": "could have", "couldn't": "could not", "couldn't've": "could not have",
    "didn't": "did not", "doesn't": "does not", "don't": "do not", "hadn't": "had not", "hasn't": "has not",
    "haven't": "have not", "he'd": "he would", "he'll": "he will", "he's": "he is", "how'd": "how did",
    "how'll": "how will", "how's": "how is", "i'd": "i would", "i'll": "i will", "i'm": "i am",
    "i've": "i have", "isn't": "is not", "it'd": "it would", "it'll": "it will", "it's": "it is",
    "let's": "let us", "ma'am": "madam", "mightn't": "might not", "might've": "might have",
    "mustn't": "must not", "must've": "must have", "needn't": "need not", "o'clock": "of the clock",
    "shan't": "shall not", "she'd": "she would", "she'll": "she will", "she's": "she is",
    "should've": "should have", "shouldn't": "should not", "that'd": "that would", "that's": "that is",
    "there'd": "there would", "there's": "there is", "they'd": "they would", "they'll": "they will",
    "they're": "they are", "they've": "they have", "wasn't": "was not", "we'd": "we would",
    "we'll": "we will", "we're": "we are", "we've": "we have", "weren't": "were not",
    "what'll": "what will", "what're": "what are", "what's": "what is", "what've": "what have",
    "when's": "when is", "where'd": "where did", "where's": "where is", "who'll": "who will",
    "who's": "who is", "who've": "who have", "why's": "why is", "won't": "will not",
    "would've": "would have", "wouldn't": "would not", "y'all": "you all", "you'd": "you would",
    "you'll": "you will", "you're": "you are", "you've": "you have",
}

_CONTRACTION_RE = re.compile(
    r"(?<![\w'])(" + "|".join(re.escape(k) for k in sorted(CONTRACTIONS, key=len, reverse=True)) + r")(?![\w'])",
    flags=re.IGNORECASE,
)
_HTML_RE = re.compile(r"<[^>]*>|&(?:[a-z0-9]+|#[0-9]{1,6}|#x[0-9a-f]{1,6});", flags=re.IGNORECASE)
_PUNCTUATION_TABLE = str.maketrans("", "", string.punctuation)
# basic_english: these characters become separate tokens; '"' is dropped, ';' ':' and <br /> split words.
_SPLIT_OFF_RE = re.compile(r"([.,()!?'])")
_DROP_RE = re.compile(r'"')
_SPACE_RE = re.compile(r"<br\s*/?>|[;:]")


class VocabularyError(ValueError):
    """A vocabulary file is missing, unreadable or of an unknown shape (the message names it)."""


def remove_html_tags(text: str) -> str:
    """Drop HTML tags (``<b>``) and character entities (``&amp;``, ``&#39;``)."""
    return _HTML_RE.sub("", text)


def expand_contractions(text: str) -> str:
    """Expand contractions (``don't`` -> ``do not``, case-insensitively, keeping the first
    letter's case), then drop the remaining apostrophes (``’`` counts as ``'``), as TorchServe's."""
    text = text.replace("\u2019", "'")

    def expand(match: re.Match[str]) -> str:
        found = match.group(0)
        expansion = CONTRACTIONS[found.lower()]
        return found[0] + expansion[1:] if found[0].isalpha() else expansion

    return _CONTRACTION_RE.sub(expand, text).replace("'", "")


def remove_accented_characters(text: str) -> str:
    """``café`` -> ``cafe``: NFKD-decompose and keep the ASCII part."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def remove_punctuation(text: str) -> str:
    """Delete every ASCII punctuation character (``string.punctuation``)."""
    return text.translate(_PUNCTUATION_TABLE)


def basic_english_tokenize(text: str) -> list[str]:
    """torchtext's ``basic_english`` tokenizer: lower-case, split off ``. , ( ) ! ? '``,
    drop ``"``, treat ``; :`` and ``<br />`` as spaces, split on whitespace."""
    text = _SPACE_RE.sub(" ", text.lower())
    text = _DROP_RE.sub("", text)
    return _SPLIT_OFF_RE.sub(r" \1 ", text).split()


def ngrams(tokens: Sequence[str], n: int) -> Iterator[str]:
    """torchtext's ``ngrams_iterator``: every token, then every 2-gram ... n-gram joined by a space."""
    yield from tokens
    for size in range(2, n + 1):
        for start in range(len(tokens) - size + 1):
            yield " ".join(tokens[start:start + size])


class Vocabulary:
    """Token -> index lookup (a subset of torchtext's ``Vocab`` API); unknown tokens get
    ``default_index``, else ``"<unk>"``'s index, else 0."""

    def __init__(self, stoi: Mapping[str, int], default_index: int | None = None) -> None:
        self._stoi = dict(stoi)
        if default_index is None:
            default_index = self._stoi.get(UNKNOWN_TOKEN, 0)
        self._default = int(default_index)

    def __getitem__(self, token: str) -> int:
        return self._stoi.get(token, self._default)

    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __len__(self) -> int:
        return len(self._stoi)

    def lookup_indices(self, tokens: Iterable[str]) -> list[int]:
        """Indices of ``tokens`` (unknown ones get the default index)."""
        return [self[t] for t in tokens]

    def get_stoi(self) -> dict[str, int]:
        """The token -> index dict."""
        return dict(self._stoi)

    def get_itos(self) -> list[str]:
        """Tokens ordered by index (indices without a token are ``""``)."""
        itos = [""] * (max(self._stoi.values(), default=-1) + 1)
        for token, index in self._stoi.items():
            itos[index] = token
        return itos

    def get_default_index(self) -> int:
        """The index returned for unknown tokens."""
        return self._default


def _vocabulary_from(data: Any, name: str) -> Vocabulary:
    """Build a :class:`Vocabulary` from plain data. Raises VocabularyError."""
    default = None
    if isinstance(data, Mapping) and ("stoi" in data or "itos" in data):
        default = data.get("default_index")
        data = data.get("stoi", data.get("itos"))
    if isinstance(data, Mapping) and all(isinstance(k, str) and isinstance(v, int) for k, v in data.items()):
        return Vocabulary(data, default)
    if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
        return Vocabulary({t: i for i, t in enumerate(data)}, default)
    raise VocabularyError(
        f"vocabulary {name!r} must be a token -> index object, a list of tokens, or "
        f"{{\"stoi\": ..., \"default_index\": ...}}, got {type(data).__name__}"
    )


def load_vocabulary(path: str, *, weights_only: bool = True, name: str | None = None) -> Any:
    """Read a vocabulary: JSON (``{"token": index}``, ``["token", ...]`` or ``{"stoi", "default_index"}``)
    or a ``torch.save`` file of the same plain data. ``weights_only=False`` also unpickles objects
    (a torchtext ``Vocab``; runs arbitrary code) and returns one with neither shape as is.

    Raises:
        VocabularyError: missing, unreadable, of an unknown shape, or pickled while
            ``weights_only`` (the message says how to opt in).
    """
    label = name or path
    if not os.path.isfile(path):
        raise VocabularyError(f"vocabulary file {label!r} not found")
    if path.lower().endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise VocabularyError(f"cannot read vocabulary {label!r}: {exc}") from exc
        return _vocabulary_from(data, label)
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if weights_only:
            raise VocabularyError(
                f"vocabulary {label!r} is a pickled object, refused with weights_only=True: re-save it as JSON "
                "or as plain data (torch.save(vocab.get_stoi(), path)), or set handler: {weights_only: false} "
                "in model-config.yaml if you trust this archive"
            ) from exc
        raise VocabularyError(f"cannot unpickle vocabulary {label!r}: {exc}") from exc
    except Exception as exc:
        raise VocabularyError(f"cannot read vocabulary {label!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(data, (Mapping, list, tuple)):
        return _vocabulary_from(data, label)
    if weights_only:
        raise VocabularyError(f"vocabulary {label!r} holds a {type(data).__name__}, not a vocabulary")
    get_stoi = getattr(data, "get_stoi", None)
    if callable(get_stoi):
        get_default = getattr(data, "get_default_index", None)
        default = get_default() if callable(get_default) else None
        return Vocabulary(get_stoi(), default)
    if not callable(getattr(data, "__getitem__", None)):
        raise VocabularyError(f"vocabulary {label!r} holds a {type(data).__name__}, which cannot look up tokens")
    return data
