"""Every route of the OpenAI-compatible API, added to the front's application."""

from __future__ import annotations

from fastapi import FastAPI

from lifecycle.serve.http.service import Service
from lifecycle.serve.openai.apierrors import install_error_handlers
from lifecycle.serve.openai.images import add_images
from lifecycle.serve.openai.modelcards import add_models
from lifecycle.serve.openai.runner import JobRunner
from lifecycle.serve.openai.videos import add_videos

__all__ = ["add_openai_routes"]


def add_openai_routes(app: FastAPI, service: Service, jobs: JobRunner | None) -> None:
    """The routes, and OpenAI's error shape for /v1 paths (other paths keep theirs); without
    `jobs` (an app made without a job store) the models alone."""
    install_error_handlers(app)
    add_models(app, service)
    if jobs is not None:
        add_videos(app, service, jobs)
        add_images(app, service, jobs.store)
