"""The one process-group kill and the one chat request of the harness.

Everything the harness starts leads its own process group
(``start_new_session=True``), so a kill reaches the server's children too
(mlx.launch ranks, a supervised child) and nothing else: groups are killed by
their id, never by a name.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional, Union

import requests

MODEL = "default_model"  # what mlx_lm.server calls the model given by --model


def kill_group(proc: Union[subprocess.Popen, int], *, grace_s: float = 0.0,
               wait_s: float = 30.0) -> Optional[int]:
    """Stop the process group led by proc (a Popen or a pid); returns its exit code.

    With grace_s > 0 the group gets SIGTERM first and SIGKILL only if its
    leader has not exited after grace_s seconds; otherwise SIGKILL at once.
    A bare pid cannot be waited for (it is not our child): None.
    """
    popen = proc if isinstance(proc, subprocess.Popen) else None
    pid = popen.pid if popen is not None else int(proc)
    if popen is not None and popen.poll() is not None:
        return popen.returncode
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, wait_s)):
        if sig == signal.SIGTERM and grace_s <= 0:
            continue
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if popen is None:
            continue
        try:
            return popen.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return popen.poll() if popen is not None else None


def chat_body(content: str = "hello", *, max_tokens: int = 1, stream: bool = False,
              **extra) -> dict:
    """An OpenAI chat-completion request for the server's model, greedy."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream, **extra}


def chat(url: str, content: str = "hello", *, max_tokens: int = 1, timeout=30,
         stream: bool = False, **extra) -> requests.Response:
    """POST one chat completion to url (the server's base URL)."""
    return requests.post(f"{url}/v1/chat/completions", timeout=timeout, stream=stream,
                         json=chat_body(content, max_tokens=max_tokens, stream=stream, **extra))
