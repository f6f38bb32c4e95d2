"""``drain``: abort and release every request of an engine, through the public engine API only (so a benchmark can
import it beside any checkout of infer)."""


def drain(engine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    for request_id in list(engine.requests):
        engine.release_request(request_id)
