"""An OpenAI-compatible chat-completions server for the caption node's tests, served by uvicorn + FastAPI on
127.0.0.1 as vLLM's is: /v1 answers with the tiny captioner (loraflow's local path, so its captions equal a
local run's); /slow/v1 answers after --slow seconds; /broken/v1 answers HTTP 500; /empty/v1 an empty caption.

    python tests/caption_server.py --port N --model DIR

(No `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotation as a class.)"""

import argparse
import asyncio
import base64
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def app(model_dir: str, slow: float):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from PIL import Image

    from tasks.captioning.vlm import Captioner
    from tasks.models.loading.text_load import TextLoading

    api, captioners = FastAPI(), {}

    def caption(body: dict) -> str:
        parts = body["messages"][0]["content"]
        url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
        prompt = next(p["text"] for p in parts if p["type"] == "text")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
        settings = {"prompt": prompt, "max_new_tokens": body["max_tokens"], "temperature": body["temperature"],
                    "seed": body["seed"], "max_pixels": None}
        key = tuple(sorted((k, str(v)) for k, v in settings.items()))
        if key not in captioners:
            captioners[key] = Captioner(Path(model_dir), "float32", TextLoading(), "cpu", settings)
        return captioners[key].caption([image])[0]

    def answer(text: str) -> dict:
        return {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                          "message": {"role": "assistant", "content": text}}]}

    @api.post("/v1/chat/completions")
    async def ok(request: Request):
        return answer(caption(await request.json()))

    @api.post("/slow/v1/chat/completions")
    async def late(request: Request):
        await asyncio.sleep(slow)
        return answer(caption(await request.json()))

    @api.post("/broken/v1/chat/completions")
    async def broken(request: Request):
        return JSONResponse({"error": {"message": "model 'nope' is not served"}}, status_code=500)

    @api.post("/empty/v1/chat/completions")
    async def empty(request: Request):
        return answer("")

    @api.get("/health")
    async def health():
        return {"ok": True}

    return api


if __name__ == "__main__":
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--slow", type=float, default=5.0)
    args = ap.parse_args()
    uvicorn.run(app(args.model, args.slow), host="127.0.0.1", port=args.port, log_level="warning")
