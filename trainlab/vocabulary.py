"""The command-line vocabulary: each concept a command takes has one flag, spelled the same in every command.

| concept                                   | flag                      | value                 |
|-------------------------------------------|---------------------------|-----------------------|
| a command's own folder (record, resume)   | --run-dir                 | DIR                   |
| a folder of output files                  | --out-dir                 | DIR                   |
| one output file                           | --out                     | PNG                   |
| sampled token maps                        | --save-tokens             | PT                    |
| weights of one network                    | --<network>-weights       | PATH                  |
| weights a training run starts from        | --init-from               | PATH                  |
| the checkpoint a training run resumes     | --resume                  | auto, never or PATH   |
| the device                                | --device                  | auto, cpu, cuda, ...  |
| the seed                                  | --seed                    | 0 .. 2**63 - 1        |
| how many seeds, results, ...              | --num-seeds, --num-results, --samples-per-class | N |
| classifier-free guidance                  | --guidance                | SCALE                 |
| class ids                                 | --classes (several), --class (one) | ID           |
| generated images to evaluate              | --samples                 | DIR or NPZ            |
| a machine-readable answer                 | --json                    | (switch)              |

`VOCABULARY` is that table, term by term: the flag, what it names, the placeholder `--help` shows, the commands that
take it and the spellings it replaced (accepted with a warning until the next release, hidden from `--help`).
`tests/test_cli_vocabulary.py` checks every command's parser against it: a command that takes a concept spells it
this way with this placeholder, no command shows a former or another library's spelling, every `-weights` flag is a
term, a `-dir` flag is `--run-dir` or `--out-dir`, and no help text mentions a former spelling. Flags of other
libraries are answered in `trainlab.config` (`FOREIGN_FLAGS`: did you mean; `FOREIGN_ALIASES`: accepted where the
meaning is identical).

Commands are named as typed: `train toy`, `eval knn`, `bench precision`; `train *` is every recipe (`trainlab plan
RECIPE` takes the same flags as `trainlab train RECIPE`, plus `plan`'s own).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """One concept of the command line.

    Attributes:
        flag: its one spelling.
        meaning: what it names, the same in every command that takes it.
        metavar: the placeholder `--help` shows for its value (None: not checked, e.g. a switch or a list of choices).
        commands: the commands that take it (`train *`: every recipe).
        former: spellings it replaced in some command (accepted with a warning until the next release).
    """

    flag: str
    meaning: str
    metavar: str | None
    commands: tuple[str, ...]
    former: tuple[str, ...] = ()


VOCABULARY: tuple[Term, ...] = (
    Term(
        "--run-dir",
        "the command's own folder: what it records (config.yaml, metrics.jsonl, checkpoints, its report), locked "
        "while it runs; launched again on the same folder, the command resumes",
        "DIR",
        ("train *", "eval linear-probe", "bench precision", "demo", "doctor"),
        former=("--out-dir",),  # bench precision
    ),
    Term(
        "--out-dir",
        "a folder of output files that is not a run (images, tables, plots)",
        "DIR",
        ("report", "sample"),
        former=("--out",),  # report
    ),
    Term("--out", "one output file (an image)", "PNG", ("sample", "edit")),
    Term("--save-tokens", "the sampled token maps, one int64 tensor per scale", "PT", ("sample", "edit")),
    Term(
        "--tokenizer-weights",
        "the multi-scale VQVAE's weights: vae_ch160v4096z32.pth, or a trainlab tokenizer export or checkpoint",
        "PATH",
        ("train var", "sample", "edit"),
        former=("--tokenizer", "--vae", "--vae-weights"),
    ),
    Term(
        "--var-weights",
        "VAR's weights: var_d16.pth, or a trainlab VAR export or checkpoint",
        "PATH",
        ("sample", "edit"),
        former=("--var",),
    ),
    Term(
        "--moco-weights",
        "MoCo v3 weights: an official main_moco.py checkpoint or a trainlab run's checkpoint ('': random init)",
        "PATH",
        ("train linear-probe", "eval knn", "eval linear-probe"),
        former=("--checkpoint",),
    ),
    Term("--judge-weights", "the demo's digit judge", "PATH", ("eval judge",), former=("--judge",)),
    Term(
        "--inception-weights",
        "torch-fidelity's Inception weights file (nothing is downloaded)",
        "PATH",
        ("train tokenizer", "eval fid"),
    ),
    Term("--perceptual-weights", "VGG16 (+ LPIPS) weights of the perceptual loss", "PATH", ("train tokenizer",)),
    Term("--init-from", "weights a training run starts from instead of its random init", "PATH", ("train var",)),
    Term(
        "--resume",
        "auto (continue from the run directory's checkpoint), never, or the checkpoint file to continue from",
        "auto|never|PATH",
        ("train *", "eval linear-probe"),
    ),
    Term(
        "--device",
        "the device to compute on",
        None,
        (
            "train *",
            "eval linear-probe",
            "bench precision",
            "sample",
            "edit",
            "eval knn",
            "eval fid",
            "eval judge",
            "demo",
            "doctor",
        ),
    ),
    Term(
        "--seed",
        "the one seed of everything random the command does",
        "SEED",
        ("train *", "eval linear-probe", "sample", "edit", "eval knn", "demo"),
    ),
    Term("--num-seeds", "how many seeds (0 .. N-1) each setting runs with", "N", ("bench precision",), ("--seeds",)),
    Term("--num-results", "how many results one input gets", "N", ("edit",), former=("--n",)),
    Term(
        "--samples-per-class",
        "how many images each class gets",
        "N",
        ("sample", "demo"),
        former=("--n-per-class",),
    ),
    Term("--guidance", "the classifier-free guidance scale", "SCALE", ("sample", "edit", "demo"), former=("--cfg",)),
    Term("--classes", "class ids (several)", "ID", ("sample",)),
    Term("--class", "a class id (one)", "ID", ("edit",), former=("--label",)),
    Term("--samples", "generated images: a folder of PNGs or an .npz", "DIR|NPZ", ("eval fid", "eval judge")),
    Term(
        "--json", "print a machine-readable answer instead of the table", None, ("runs", "plan", "doctor", "bench data")
    ),
)


def term(flag: str) -> Term | None:
    """The vocabulary's term spelled `flag`, or None."""
    return next((t for t in VOCABULARY if t.flag == flag), None)
