"""Schemathesis hooks for test_fuzz: generated bodies name the served model, so that requests get past the 404 and
reach validation, the template and the engine."""
import schemathesis

MODEL = "smollm2-135m"


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
