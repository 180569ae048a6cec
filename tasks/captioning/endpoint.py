"""An OpenAI-compatible chat-completions server the user already runs (vLLM, Ollama, llama.cpp's server, LM
Studio): `caption.endpoint=http://127.0.0.1:8000/v1`, `caption.model=` the name it serves. One request per
image, the image as a PNG data URL beside the prompt; caption.timeout bounds each request. The identity of
such a captioner in the cache key is its URL and model name: the server's weights are not seen."""
from __future__ import annotations

import base64
import io

from tasks.captioning import CaptionError


def image_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class EndpointCaptioner:
    def __init__(self, url: str, model: str, settings: dict, timeout: float):
        import httpx

        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.settings = model, settings
        self.client = httpx.Client(timeout=timeout)
        self.timeout = timeout

    def caption_one(self, image, name: str) -> str:
        import httpx

        s = self.settings
        body = {"model": self.model, "max_tokens": s["max_new_tokens"], "temperature": s["temperature"],
                "seed": s["seed"], "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image_url(image)}},
                    {"type": "text", "text": s["prompt"]}]}]}
        where = f"caption.endpoint={self.url.rsplit('/chat/completions', 1)[0]}"
        try:
            response = self.client.post(self.url, json=body)
        except httpx.TimeoutException:
            raise CaptionError(f"{where}: no answer within caption.timeout={self.timeout:g} s for {name}; check the "
                               "server is up and serving caption.model, or raise caption.timeout") from None
        except httpx.HTTPError as e:
            raise CaptionError(f"{where}: cannot reach the server for {name} ({type(e).__name__}: {e}); start it "
                               "or fix caption.endpoint") from None
        if response.status_code != 200:
            detail = " ".join(response.text.split())[:200]
            raise CaptionError(f"{where}: the server answered HTTP {response.status_code} for {name} ({detail}); "
                               f"check that it serves caption.model={self.model} and takes images") from None
        try:
            text = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise CaptionError(f"{where}: the answer for {name} is not a chat completion "
                               f"({' '.join(response.text.split())[:200]}); is it an OpenAI-compatible /v1 URL?") from None
        return (text or "").strip()

    def caption(self, images: list, names: list[str]) -> list[str]:
        return [self.caption_one(img, n) for img, n in zip(images, names)]

    def close(self) -> None:
        self.client.close()
