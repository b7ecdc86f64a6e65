"""TorchServe's built-in text handlers: ``TextHandler`` and ``text_classifier``.

Same names, methods and input/output contract as TorchServe 0.12's
``ts.torch_handler.text_handler`` / ``text_classifier`` (which import these
classes), without torchtext (see :mod:`inference_service.handler.text_processing`).
"""

from __future__ import annotations

import os
from typing import Any

from inference_service.handler import text_processing
from inference_service.handler.base_handler import BaseHandler, ModelLoadError
from inference_service.handler.context import Context
from inference_service.handler.explanations import token_importances
from inference_service.handler.timer import timed
from inference_service.handler.util import PredictionException, map_class_to_label

VOCAB_FILES = ("source_vocab.json", "source_vocab.pt")


class TextHandler(BaseHandler):
    """Base of the text handlers: loads the model and the source vocabulary, cleans text.

    The vocabulary is the manifest's ``sourceVocab``, else ``source_vocab.json``, else
    ``source_vocab.pt`` (plain data, ``torch.load(weights_only=True)``); unknown tokens map to
    ``"<unk>"``'s index, else 0. TorchServe's archives pickle a torchtext ``Vocab``: those load only
    with ``handler: {weights_only: false}`` and torchtext installed. The cleanup helpers keep
    TorchServe's names (misspelling included).
    """

    def __init__(self) -> None:
        super().__init__()
        self.source_vocab: Any = None
        self.tokenizer = text_processing.basic_english_tokenize
        self.input_text: Any = None

    def initialize(self, context: Context) -> None:
        """Load the model, then the source vocabulary.

        Raises:
            ModelLoadError: no vocabulary file, or it cannot be read (the message names the file and,
                for pickled ones, how to opt in).
        """
        super().initialize(context)
        self.initialized = False
        path = self.get_source_vocab_path(context)
        try:
            self.source_vocab = text_processing.load_vocabulary(
                path, weights_only=self._weights_only(), name=self._display_name(path)
            )
        except text_processing.VocabularyError as exc:
            raise ModelLoadError(str(exc)) from exc
        self.initialized = True

    def get_source_vocab_path(self, ctx: Context) -> str:
        """Path of the vocabulary file; ModelLoadError when none exists."""
        model_dir = ctx.system_properties.get("model_dir") or ""
        legacy = (self.manifest.get("model") or {}).get("sourceVocab")
        if legacy:
            return legacy if os.path.isabs(legacy) else os.path.join(model_dir, legacy)
        for name in VOCAB_FILES:
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                return path
        raise ModelLoadError(
            f"missing the source vocabulary: archive {' or '.join(VOCAB_FILES)} with --extra-files"
        )

    def _remove_html_tags(self, text: str) -> str:
        return text_processing.remove_html_tags(text)

    def _expand_contractions(self, text: str) -> str:
        return text_processing.expand_contractions(text)

    def _remove_accented_characters(self, text: str) -> str:
        return text_processing.remove_accented_characters(text)

    def _remove_punctuation(self, text: str) -> str:
        return text_processing.remove_punctuation(text)

    def _remove_puncutation(self, text: str) -> str:
        """TorchServe's original (misspelled) name of :meth:`_remove_punctuation`."""
        return self._remove_punctuation(text)

    def _tokenize(self, text: str) -> list[str]:
        return self.tokenizer(text)

    def get_word_token(self, input_tokens: list[str]) -> list[str]:
        """Tokens without the BPE word-start marker ``Ġ`` (TorchServe's helper)."""
        return [token.replace("\u0120", "") for token in input_tokens]

    def clean_text(self, text: str) -> list[str]:
        """TorchServe's text classifier cleanup: HTML, lower case, contractions, accents,
        punctuation, then tokens."""
        text = self._remove_html_tags(text)
        text = text.lower()
        text = self._expand_contractions(text)
        text = self._remove_accented_characters(text)
        text = self._remove_punctuation(text)
        return self._tokenize(text)


class TextClassifier(TextHandler):
    """``text_classifier``: UTF-8 text -> ``{"label": probability}`` for every class, as TorchServe's.

    Tokens and their 2-grams are looked up and passed as ``model(token_ids, offsets)`` (one 1-D
    ``long`` tensor for the batch, the ``nn.EmbeddingBag`` convention of TorchServe's example);
    unlike TorchServe, which classifies only a batch's first request, each request gets its answer.
    """

    ngrams = 2

    def _request_text(self, row: Any) -> str:
        """One request's text. Raises PredictionException (400) naming the problem."""
        payload = (row.get("data") or row.get("body")) if isinstance(row, dict) else None
        if isinstance(payload, (bytes, bytearray, memoryview)):
            try:
                return bytes(payload).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PredictionException(f"text is not valid UTF-8: {exc}", 400) from exc
        if isinstance(payload, str) and payload:
            return payload
        raise PredictionException("no text: send it in the input 'data' (or 'body')", 400)

    @timed
    def preprocess(self, data: list[dict[str, Any]]) -> tuple[Any, Any]:
        """``(token_ids, offsets)`` of the batch.

        Raises:
            PredictionException: (400) no text or not UTF-8 in a batch of one, or in every request of
                the batch; in a larger batch a bad request alone fails (its status set to 400).
        """
        import torch

        ids: list[int] = []
        offsets: list[int] = []
        failures: dict[int, str] = {}
        self.input_text = []  # each request's words and n-grams (what get_insights names)
        for idx, row in enumerate(data):
            offsets.append(len(ids))
            try:
                text = self._request_text(row)
            except PredictionException as exc:
                failures[idx] = exc.message
                self.input_text.append([])
                continue
            words = list(text_processing.ngrams(self.clean_text(text), self.ngrams))
            self.input_text.append(words)
            ids.extend(self.source_vocab[word] for word in words)
        if failures:
            if len(failures) == len(data):
                first = min(failures)
                raise PredictionException(("" if len(data) == 1 else f"request {first} of the batch: ")
                                          + failures[first], 400)
            for idx, message in failures.items():
                if self.context is not None:
                    self.context.set_response_status(400, message, idx)
        return (torch.as_tensor(ids, dtype=torch.long, device=self.device),
                torch.as_tensor(offsets, dtype=torch.long, device=self.device))

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """``model(token_ids, offsets)``; a preprocess returning TorchServe's ``(tensor, text)`` gets offset 0."""
        import torch

        text_tensor, offsets = data
        if not isinstance(offsets, torch.Tensor):
            offsets = torch.as_tensor([0], device=self.device)
        return super().inference(text_tensor, offsets, *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> list[dict[str, float]]:
        """Softmax the ``N x classes`` output; ``[{label: probability}]`` per request."""
        import torch

        probabilities = torch.nn.functional.softmax(data, dim=1)
        return map_class_to_label(probabilities.tolist(), self.mapping)

    def get_insights(self, text_preprocess: Any, _: Any, target: int = 0) -> list[dict[str, Any]]:
        """Per request ``{"words": [...], "importances": [...]}``: its words then n-grams, each with its
        Layer Integrated Gradients score of class ``target`` at ``model.embedding`` (TorchServe's layer
        and reference; see :func:`~inference_service.handler.explanations.token_importances`). A
        preprocess of TorchServe's form, ``(token ids, words)``, explains that one text."""
        import torch

        ids, offsets = text_preprocess
        if not isinstance(offsets, torch.Tensor):
            return [{"words": list(offsets), "importances": token_importances(self.model, self.model.embedding, ids,
                                                                              target)}]
        bounds = [*offsets.tolist(), len(ids)]
        out = []
        for words, start, end in zip(self.input_text, bounds, bounds[1:], strict=False):
            scores = token_importances(self.model, self.model.embedding, ids[start:end], target) if words else []
            out.append({"words": words, "importances": scores})
        return out
