"""The program's name and the settings fixed in code: the run's defaults, the embedded
model's size, AdamW's betas and eps, the held-out windows."""

PROG = "elastic-finetune"
CHECKPOINT_FORMAT = "elastic-finetune-checkpoint/2"  # /2: manifest.json (sha256 of every file, the run's id)
MANIFEST_FORMAT = "elastic-finetune-manifest/1"
PROBE_SEQS = 4  # held-out windows at the end of the token stream (held-out loss, logits check)
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
EMBEDDED_VOCAB = 257  # UTF-8 bytes + end of document
EMBEDDED_MAX_POSITIONS = 4096

# The embedded model and the default run, sized so that `make demo` (4 gloo processes, the
# elastic run at full and at zero budget plus the FSDP2 baseline) finishes in under 5 minutes
# on the 2-core development machine; see NOTES.md ("The main job") for the measurement.
EMBEDDED = dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4)
DEFAULT_STEPS = 30
DEFAULT_SEQ_LEN = 128
DEFAULT_MICRO_BATCH = 2
DEFAULT_GRAD_ACCUM = 2
