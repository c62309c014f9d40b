"""Images in prompts: the runner's ``Images`` step plug-in, which talks to the model's ``VisionPart``.

A request's images become inputs where its prompt marks them (``[img-N]``, Ollama's marker; without
markers they come first): each image's bytes are decoded and preprocessed once, on the requesting
thread (a bad image fails its request before it queues), and the vision part gives the inputs that
stand for it (marker tokens and placeholders, ``same_batch`` keeping its rows in one batch; their
number may depend on the image: dynamic resolution). An image's vision graph is computed (by the
engine, in a graph of its own kept per input shape, outside the text batches) before the scheduler
packs its inputs; the embeddings then stay with the input, so a prompt cache hit on the image's
inputs does not encode it again (inputs compare by the image's hash).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from pyggml.input import Input, Multimodal, text_input
from pyggml.models import VisionPart
from pyggml.runner.plugins import StepPlugin

if TYPE_CHECKING:
    from pyggml.runner.runner import Runner

log = logging.getLogger(__name__)
IMAGE_MARK = re.compile(r"\[img-(\d+)\]")  # where an image goes in a prompt (Ollama's marker)


class Images(StepPlugin):
    """Encodes the images among the next inputs of each sequence before a batch is packed.
    ``run``: the most inputs one image needs in one batch (``same_batch`` + 1, for the vision part's
    largest image); 0 when the model's vocabulary cannot place images (requests with images then
    fail with its reason)."""

    def __init__(self, runner: Runner, vision: VisionPart):
        self.runner, self.vision = runner, vision
        self.run = self._longest_run()

    def _longest_run(self) -> int:
        largest = Input(multimodal=[Multimodal(data=self.vision.worst_case())], multimodal_hash=1)
        try:
            inputs = self.vision.placeholders(largest, self.runner.tokenizer)
        except Exception as exc:  # e.g. no image marker tokens: requests with images fail with this error
            log.warning("the model cannot place images in its input: %r", exc)
            return 0
        return max((inp.same_batch + 1 for inp in inputs if inp.same_batch), default=0)

    def reserve(self) -> list[np.ndarray]:
        """Build the model's largest image graph (the engine keeps it for the first image) and reserve
        its compute memory. Returns zero embeddings shaped like an image's, for the text batch."""
        try:
            return self.runner.engine.reserve_multimodal()
        except MemoryError as exc:
            raise MemoryError(f"not enough memory to encode an image (the vision graph of the "
                              f"{self.runner.model.architecture or 'loaded'} model): free memory, or load it "
                              f"without its vision part ({exc})") from exc

    def prompt_inputs(self, prompt: str | Sequence[int], images: Sequence[bytes]) -> list[Input]:
        """The input stream of a prompt with images: text tokens around the inputs of each image."""
        r = self.runner
        if not isinstance(prompt, str):
            raise ValueError("a prompt with images must be text (mark each image with [img-N])")
        if isinstance(images, (bytes, str)) or not all(isinstance(b, (bytes, bytearray)) and b for b in images):
            raise ValueError("images must be a list of non-empty byte strings (image files)")
        parts = IMAGE_MARK.split(prompt)  # text, index, text, index, ...
        if len(parts) == 1:  # no markers: the images come first, as Ollama places them
            parts = ["", *[x for i in range(len(images)) for x in (str(i), "")]]
            parts[-1] = prompt
        self._check_count(len(parts) // 2)
        inputs: list[Input] = []
        decoded: dict[int, Input] = {}  # an image named twice is decoded once
        for k, part in enumerate(parts):
            if k % 2 == 0:
                if part or k == 0:  # the first piece carries the BOS token, even when empty
                    inputs += [text_input(t) for t in r.tokenizer.encode(part, add_special=k == 0)]
                continue
            index = int(part)
            if index >= len(images):
                raise ValueError(f"the prompt names [img-{index}] but the request has {len(images)} image(s)")
            if index not in decoded:
                data = bytes(images[index])
                decoded[index] = Input(multimodal=[Multimodal(data=self.vision.preprocess(data))],
                                       multimodal_hash=image_hash(data))
            inputs += self.vision.placeholders(decoded[index], r.tokenizer)
        self._check_run(inputs)
        return inputs

    def _check_count(self, n: int) -> None:
        most = self.vision.max_images
        if most is not None and n > most:
            name = self.runner.model.architecture or "the model"
            raise ValueError(f"{name} attends to {'one image' if most == 1 else f'{most} images'} at a time; "
                             f"the prompt has {n}")

    def _check_run(self, inputs: list[Input]) -> None:
        longest = max((inp.same_batch + 1 for inp in inputs if inp.same_batch), default=0)
        room = max(self.runner.batch_size, self.run)
        if longest > room:
            raise ValueError(f"an image takes {longest} inputs in one batch but the runner's batches hold "
                             f"{room}; raise batch_size")

    def before_build(self) -> None:
        """Encode the images among each sequence's next ``batch_size`` inputs (the ones the scheduler
        may pack now). An image that does not encode fails its sequence only."""
        r = self.runner
        for seq in list(r.active):
            if not r.scheduler.feeds(seq):
                continue
            for inp in islice(seq.pending, r.batch_size):
                if inp.multimodal and inp.multimodal[0].tensor is None:
                    try:
                        self._encode(inp)
                    except Exception as exc:
                        r.fail_sequence(seq, exc)
                        break

    def _encode(self, inp: Input) -> None:
        """Compute an image's vision graph (the engine's, built once per image shape; the result stays
        with its input, in host memory)."""
        self.runner.wait_in_flight()  # one graph computes at a time
        inp.multimodal = [m for item in inp.multimodal for m in self.runner.engine.encode(item.data)]


def image_hash(data: bytes) -> int:
    """What the prompt cache compares images by."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
