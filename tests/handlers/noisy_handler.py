"""Makes the noise libraries make while loading: a Python warning (twice), a tqdm progress bar
and a warning on a library's logger (transformers'). Answers the body."""
import logging
import warnings

from tqdm import tqdm


def handle(data, context):
    if data is None:  # the load-time call
        for _ in range(2):
            warnings.warn("noisy library warning", UserWarning, stacklevel=1)
        for _ in tqdm(range(3), desc="noisy progress"):
            pass
        logging.getLogger("transformers.noisy").warning("noisy transformers warning")
        return None
    return [row.get("data") or row.get("body") or b"" for row in data]
