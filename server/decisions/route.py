"""POST /v1/decisions (OpenAI's) and POST /v1/systemone (System One's): thin handlers over ``reading.ask``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.decisions import protocol as wire
from server.decisions.reading import ask
from server.http.prepare import engine_for
from server.http.run import race_disconnect
from server.openai.protocol import new_id

router = APIRouter(tags=["decisions"])


def _counts(answers: list) -> dict[str, int]:
    refused = sum(1 for a in answers if a is None)
    return {"answered": len(answers) - refused, "refused": refused}


@router.post("/v1/decisions", summary="Answer typed questions about an input (OpenAI's Decisions API)")
async def create_decision(body: wire.DecisionRequest, request: Request) -> JSONResponse:
    arrival = time.perf_counter()
    state, engine = await engine_for(request, body.model)
    parsed = body.parsed_questions()
    outcome = await race_disconnect(request, ask(engine, body.messages(), [q for q, _ in parsed], new_id("dec"),
                                                 body.chat_template_kwargs))
    items = body.questions
    answers = [wire.openai_answer(item, name, answer)
               for item, (_, name), answer in zip(items, parsed, outcome.answers)]
    state.metrics.readout_done("decisions", arrival, _counts(outcome.answers), request.state.ortserve_model)
    return JSONResponse({"answers": answers, "model": request.state.ortserve_model,
                         "usage": wire.openai_usage(outcome.num_input_tokens, outcome.num_cached_tokens)})


def _systemone_model(name: str | None) -> str | None:
    """NOTE(server): clients written against TypeSafe's Jev name its models (jev, jev-latest, jev-1.13.0): those names
    mean this server's chat model; ``model`` in the answer says which one answered."""
    return None if name is not None and (name == "jev" or name.startswith("jev-")) else name


@router.post("/v1/systemone", summary="Answer named questions about a state (System One's format)")
async def create_systemone(body: wire.SystemOneRequest, request: Request) -> JSONResponse:
    arrival = time.perf_counter()
    state, engine = await engine_for(request, _systemone_model(body.model))
    parsed = body.parsed_questions()
    outcome = await race_disconnect(request, ask(engine, body.messages(), [q for _, q in parsed], new_id("s1"),
                                                 body.chat_template_kwargs, input_param="state"))
    # NOTE(server): as System One does, a question the model cannot answer is left out of ``answers``.
    answers = {name: wire.systemone_answer(q, answer)
               for (name, q), answer in zip(parsed, outcome.answers) if answer is not None}
    state.metrics.readout_done("systemone", arrival, _counts(outcome.answers), request.state.ortserve_model)
    return JSONResponse({"model": request.state.ortserve_model, "answers": answers,
                         "usage": {"input_tokens": outcome.num_input_tokens, "output_tokens": 0,
                                   "cached_tokens": outcome.num_cached_tokens}})
