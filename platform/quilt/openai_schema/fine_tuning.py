"""OpenAI's Files and Fine-tuning APIs under /v1, as finetuning.views takes them and finetuning.wire answers them."""

from quilt.openai_schema.shapes import (
    UNIX_TIME,
    array,
    boolean,
    const,
    integer,
    nullable,
    number,
    obj,
    ref,
    text,
)


def _hyperparameter(description: str, **bounds) -> dict:
    return {"oneOf": [text(enum=["auto"]), number(**bounds)], "description": description}


HYPERPARAMETERS = obj({
    "n_epochs": _hyperparameter("Whole integer 1..50; auto: enough for about 100 optimizer steps (1..10 epochs).",
                                minimum=1, maximum=50),
    "batch_size": _hyperparameter("Whole integer 1..256; auto: about 5% of the examples (1..16).", minimum=1,
                                  maximum=256),
    "learning_rate_multiplier": _hyperparameter("Times the platform's base learning rate; auto: 1.", maximum=100),
    "lora_rank": _hyperparameter("Quilt's own: the adapter's LoRA rank, up to the platform's limit; auto: the "
                                 "platform's default.", minimum=1),
    "lora_alpha": _hyperparameter("Quilt's own: LoRA alpha; auto: twice the rank.", maximum=4096),
    "beta": _hyperparameter("DPO only: the preference strength; auto: 0.1.", maximum=2),
}, description="Each \"auto\" or a value; an unknown name or a value out of range is a 400 "
               "(`invalid_hyperparameter`). The job records the values it resolved.")  # fmt: skip
METHOD = obj({
    "type": text(enum=["supervised", "dpo"]),
    "supervised": obj({"hyperparameters": ref("FineTuningHyperparameters")}),
    "dpo": obj({"hyperparameters": ref("FineTuningHyperparameters")}),
}, ("type",), description="The training method; without it, supervised with the top-level `hyperparameters`.")
JOB_REQUEST = obj({
    "model": text("The base model to fine-tune."),
    "training_file": text("The id of a file uploaded with purpose `fine-tune`: chat examples (`{\"messages\": "
                          "[...]}` per line) for supervised, `{\"input\", \"preferred_output\", "
                          "\"non_preferred_output\"}` per line for DPO."),
    "validation_file": nullable(text("Another such file, evaluated as training goes.")),
    "suffix": nullable(text("The adapter's name: the job's result is a new version of that adapter, which "
                            "`model` then names.")),
    "hyperparameters": nullable(ref("FineTuningHyperparameters")),
    "method": nullable(ref("FineTuningMethod")),
    "seed": nullable(integer(minimum=0, maximum=2**31 - 1)),
    "metadata": nullable({"type": "object", "additionalProperties": text(maxLength=512), "maxProperties": 16,
                          "description": "Up to 16 keys of at most 64 characters, to strings."}),
}, ("model", "training_file"), description="Other fields are ignored.")  # fmt: skip

FILE = obj({
    "id": text(), "object": const("file"), "bytes": integer(minimum=0), "created_at": UNIX_TIME,
    "filename": text(), "purpose": text(), "status": const("processed", "Files are checked when uploaded."),
    "status_details": nullable(text()), "expires_at": nullable(integer()),
}, ("id", "object", "bytes", "created_at", "filename", "purpose", "status"))  # fmt: skip
FILE_UPLOAD = obj({
    "file": text("The JSONL training data; checked line by line when uploaded (a bad line is a 400 naming it).",
                 format="binary"),
    "purpose": const("fine-tune"),
}, ("file", "purpose"))
FILE_DELETED = obj({"id": text(), "object": const("file"), "deleted": boolean()}, ("id", "object", "deleted"))

ERROR = nullable(obj({"code": text(), "message": text(), "param": nullable(text())}, ("code", "message", "param")))
JOB = obj({
    "id": text(), "object": const("fine_tuning.job"), "created_at": UNIX_TIME, "finished_at": nullable(UNIX_TIME),
    "model": text("The base model."),
    "fine_tuned_model": nullable(text("The model name to use once the job succeeded: `suffix@version`.")),
    "organization_id": text("The tenant's slug."),
    "status": text(enum=["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]),
    "training_file": text(), "validation_file": nullable(text()), "result_files": array(text()),
    "trained_tokens": nullable(integer(minimum=0)),
    "hyperparameters": {"type": "object", "additionalProperties": number(), "description": "The values resolved."},
    "method": {"type": "object", "description": "`{\"type\": method, method: {\"hyperparameters\": {...}}}`."},
    "seed": nullable(integer()), "suffix": nullable(text()), "error": {**ERROR, "description": "When it failed."},
    "estimated_finish": nullable(integer()), "integrations": array({"type": "object"}),
    "metadata": nullable({"type": "object", "additionalProperties": text()}),
    "user_provided_suffix": nullable(text()),
    "steps_done": nullable(integer(minimum=0)), "total_steps": nullable(integer(minimum=0)),
}, ("id", "object", "created_at", "model", "status", "training_file", "hyperparameters"))  # fmt: skip
EVENT = obj({
    "id": text(), "object": const("fine_tuning.job.event"), "created_at": UNIX_TIME,
    "level": text(enum=["info", "warn", "error"]), "message": text(), "type": text(enum=["message", "metrics"]),
    "data": nullable({"type": "object", "description": "A metrics event's step, loss and learning rate."}),
}, ("id", "object", "created_at", "level", "message", "type"))  # fmt: skip
CHECKPOINT = obj({
    "id": text(), "object": const("fine_tuning.job.checkpoint"), "created_at": UNIX_TIME,
    "fine_tuned_model_checkpoint": text(), "fine_tuning_job_id": text(), "step_number": integer(minimum=0),
    "metrics": {"type": "object", "additionalProperties": number()},
}, ("id", "object", "created_at", "fine_tuning_job_id", "step_number", "metrics"))  # fmt: skip


def page(item: str) -> dict:
    return obj({"object": const("list"), "data": array(ref(item)), "has_more": boolean()},
               ("object", "data", "has_more"), description="A page; ask for the next with `after` = the last id.")


SCHEMAS = {
    "FineTuningHyperparameters": HYPERPARAMETERS, "FineTuningMethod": METHOD, "OpenAIFile": FILE,
    "OpenAIFileDeleted": FILE_DELETED,
    "OpenAIFileList": page("OpenAIFile"), "FineTuningJob": JOB, "FineTuningJobList": page("FineTuningJob"),
    "FineTuningJobEvent": EVENT, "FineTuningJobEventList": page("FineTuningJobEvent"),
    "FineTuningJobCheckpoint": CHECKPOINT, "FineTuningJobCheckpointList": page("FineTuningJobCheckpoint"),
}  # fmt: skip
