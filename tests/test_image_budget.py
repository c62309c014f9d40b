"""Decoded image memory is admitted across requests (issue 25, item 12): every ``image.decode`` in the
process takes its pixels from one budget (``image.BUDGET``), waits for room, and gives them back when the
decoded image is freed; a server request that finds no room in time gets 503 with Retry-After."""

from __future__ import annotations

import base64
import gc
import threading

import pytest

from pyggml import image

from .hf_fixtures import png

pytest.importorskip("PIL", reason="images need Pillow")


@pytest.fixture
def budget(monkeypatch):
    """A budget of two 60x40 images, waiting at most 0.5 s, in place of the process's."""
    small = image.PixelBudget(pixels=2 * 60 * 40, timeout=0.5)
    monkeypatch.setattr(image, "BUDGET", small)
    return small


def test_the_budget_admits_waits_and_refuses():
    b = image.PixelBudget(pixels=100, timeout=0.2)
    assert b.take(60) == 60 and b.used == 60
    with pytest.raises(image.ImageBusyError, match="retry later"):
        b.take(50)
    b.give(60)
    assert b.take(1000) == 100  # larger than the budget: takes all of it, so it can still be decoded alone
    waiter_took = []
    waiter = threading.Thread(target=lambda: waiter_took.append(b.take(30)))
    b.timeout = 30.0
    waiter.start()
    waiter.join(0.2)
    assert not waiter_took  # waits while the budget is full ...
    b.give(100)
    waiter.join(10)
    assert waiter_took == [30] and b.used == 30  # ... and goes on when pixels come back


def test_a_decoded_image_holds_its_pixels_until_freed(budget):
    first = image.decode(png(1, (60, 40)))
    assert budget.used == 60 * 40
    second = image.decode(png(2, (60, 40)))
    assert budget.used == 2 * 60 * 40
    with pytest.raises(image.ImageBusyError):
        image.decode(png(3, (60, 40)))  # the budget is full for 0.5 s
    del first
    gc.collect()
    third = image.decode(png(3, (60, 40)))
    assert budget.used == 2 * 60 * 40 and third.size == (60, 40) and second.size == (60, 40)
    del second, third
    gc.collect()
    assert budget.used == 0


def test_a_failed_decode_gives_its_pixels_back(budget):
    data = png(1, (60, 40))
    with pytest.raises(image.ImageError):
        image.decode(data[: len(data) // 2])  # the header says 60x40, the pixel data is cut short
    assert budget.used == 0


def test_concurrent_decodes_never_hold_more_than_the_budget(monkeypatch):
    b = image.PixelBudget(pixels=2 * 300 * 200, timeout=60.0)
    monkeypatch.setattr(image, "BUDGET", b)
    most, lock = [0], threading.Lock()
    data = png(4, (300, 200))

    def work():
        for _ in range(3):
            decoded = image.decode(data)
            with lock:
                most[0] = max(most[0], b.used)
            decoded.resize((8, 8))
            del decoded

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < most[0] <= b.pixels and b.used == 0


def test_the_server_answers_503_when_the_budget_stays_full(tmp_path, monkeypatch):
    pytest.importorskip("httpx", reason="the server tests need: pip install starlette uvicorn httpx")
    import httpx

    from ._server import running_server
    from .test_gguf_counts import base_file

    path = base_file(tmp_path, "gemma3-vision")
    b = image.PixelBudget(timeout=0.5)
    monkeypatch.setattr(image, "BUDGET", b)
    body = {"model": "x", "prompt": "a", "images": [base64.b64encode(png(0, (20, 18))).decode()], "stream": False,
            "options": {"num_predict": 1, "temperature": 0}}
    with running_server(path) as (base, served):
        body["model"] = served.name
        ok = httpx.post(f"{base}/api/generate", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert b.used == 0  # nothing held once the request is done
        b.take(b.pixels)  # other requests' images fill the budget
        busy = httpx.post(f"{base}/api/generate", json=body, timeout=60)
        assert busy.status_code == 503 and busy.headers.get("Retry-After"), busy.text
        assert "decoding other images" in busy.text
        b.give(b.pixels)
        assert httpx.post(f"{base}/api/generate", json=body, timeout=60).status_code == 200
