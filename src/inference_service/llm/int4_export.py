"""The ``int4`` weight format: NNCF's data-aware weight compression through optimum-intel's Python
API, calibrated on ``calibration.txt`` (prose and chat written for this project, 30 passages,
about 3,100 SmolLM2 tokens; not the perplexity text of the quality bar). Run in the exporter's
process: ``python -m inference_service.llm.ir_export PID OUTPUT -- int4 MODEL_DIR OUTPUT``."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")


@dataclass(frozen=True)
class Int4Recipe:
    """NNCF's ``compress_weights`` settings of the ``int4`` format (benchmarks/RESULTS.md, "Issue 40":
    the variants measured).

    Args:
        ratio: share of the layers (by parameters) in int4, the most sensitive on the calibration
            text left in int8 (NNCF's mixed precision); the embeddings and the LM head stay int8.
        group_size: weights per int4 scale and zero point.
        awq: activation-aware scaling (AWQ).
        scale_estimation: scales fitted to the layer's outputs on the calibration text.
        gptq: GPTQ's layer-wise rounding.
    """

    ratio: float
    group_size: int
    awq: bool = True
    scale_estimation: bool = True
    gptq: bool = False


#: The recipe ``int4`` is converted with: the highest ratio measured within the quality bar
#: (+1.6 % perplexity; 0.4 gave +3.5 %, 0.8 +4.7 %, 1.0 +10.7 %).
INT4_RECIPE = Int4Recipe(ratio=0.2, group_size=64)


def calibration_texts(path: Path = CALIBRATION_FILE) -> list[str]:
    """The calibration samples: the file's passages, split at blank lines."""
    return [part.strip() for part in path.read_text(encoding="utf-8").split("\n\n") if part.strip()]


def recipe_key() -> dict[str, object]:
    """What of the int4 conversion goes into the IR cache's key: :data:`INT4_RECIPE` and the
    calibration text's hash."""
    digest = hashlib.sha256(CALIBRATION_FILE.read_bytes()).hexdigest()[:16]
    return {**asdict(INT4_RECIPE), "calibration": digest}


def export_int4(model_dir: str, output: str, recipe: Int4Recipe | None = None) -> None:
    """Export ``model_dir`` (a transformers causal LM) to ``output`` with int4 weights per ``recipe``
    (default :data:`INT4_RECIPE`), and its tokenizer files beside them, as optimum-cli's export
    writes them."""
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
    from transformers import AutoTokenizer

    recipe = recipe or INT4_RECIPE
    texts = calibration_texts()
    config = OVWeightQuantizationConfig(
        bits=4, sym=False, group_size=recipe.group_size, ratio=recipe.ratio, dataset=texts, tokenizer=model_dir,
        num_samples=len(texts), quant_method="awq" if recipe.awq else "default",
        scale_estimation=recipe.scale_estimation, gptq=recipe.gptq, backup_precision="int8_asym")
    model = OVModelForCausalLM.from_pretrained(model_dir, export=True, compile=False, quantization_config=config)
    model.save_pretrained(output)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(output)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m inference_service.llm.int4_export MODEL_DIR OUTPUT_DIR")
    export_int4(sys.argv[1], sys.argv[2])
