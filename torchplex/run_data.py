"""A run's prompts: the training records and the eval sets, read from users' files (data.train_files /
eval_files), one train/eval file pair (data.train_file / eval_file) or the synthetic task, with the bad rows counted
once for the job and the errors that name the files when nothing valid is left."""

from __future__ import annotations

from pathlib import Path

from .config.schema import DataConfig
from .data.prompts import PromptEncoder
from .data.skips import DataError, skip_counts_text
from .data.sources import BadRecords, ColumnKeys, load_records, set_name
from .data.synthetic import prepare_task
from .distributed.data_parallel import DataParallelRanks, barrier
from .evaluation import EvalSet


class RunData:
    """Reads the records at construction; `train` and `eval_sets` hold them. Every rank reads every record (each
    data-parallel rank takes its share of a step's batch later); rank 0 writes the synthetic task for all."""

    def __init__(self, d: DataConfig, encoder: PromptEncoder, dp: DataParallelRanks, rank: int):
        self.d, self.encoder, self.dp, self.rank = d, encoder, dp, rank
        self.files: dict[str, str] = {}  # phase -> the files its records came from, for error messages
        self.bad_records = BadRecords()  # rows dropped while reading: skipped/<phase>/malformed, skipped/bad_records
        self.keys = ColumnKeys(prompt=d.prompt_key, answer=d.answer_key, images=d.image_key, videos=d.video_key)
        self.train, self.eval_sets = self._read_all()
        self.bad_records.summary()
        self._check_enough()

    def _read_all(self) -> tuple[list, list[EvalSet]]:
        d = self.d
        if d.train_files:  # users' own data (data/sources.py): one eval set per eval_files entry
            return (self._read(d.train_files, "train"),
                    [EvalSet(set_name(p), self._read([p], "eval")) for p in d.eval_files])
        train_path, eval_path = self._file_pair() if d.train_file else self._synthetic_task()
        train = self._read([str(train_path)], "train")
        evals = [EvalSet("eval", self._read([str(eval_path)], "eval"), legacy=True)] if eval_path else []
        return train, evals

    def _file_pair(self) -> tuple[Path, Path | None]:
        d = self.d
        train_path, eval_path = Path(d.train_file), Path(d.eval_file) if d.eval_file else None
        for key, path in (("data.train_file", train_path), ("data.eval_file", eval_path)):
            if path is not None and not path.is_file():
                raise FileNotFoundError(f"{key} = {str(path)!r}: no such file")
        return train_path, eval_path

    def _synthetic_task(self) -> tuple[Path, Path | None]:
        """The task of data.synthetic_seed, in a folder of its own (data/synthetic.py), written by rank 0."""
        d = self.d
        task = (d.synthetic_dir, d.synthetic_task, d.synthetic_seed, d.synthetic_train, d.synthetic_eval,
                d.synthetic_size, d.synthetic_frames)
        if self.rank == 0:
            prepare_task(*task)
        barrier()
        return prepare_task(*task)

    def _read(self, patterns: list[str], phase: str) -> list:
        """Valid records of the files `patterns` match; bad rows are counted once for the job (data-parallel rank 0)
        under `phase`."""
        before = self.bad_records.total
        records = load_records(patterns, keys=self.keys, bad=self.bad_records, prompt_suffix=self.d.prompt_suffix)
        if self.dp.rank == 0:
            self.encoder.skips.add_malformed(phase, self.bad_records.total - before)
        self.files[phase] = ", ".join(filter(None, [self.files.get(phase), *patterns]))
        return records

    def _check_enough(self) -> None:
        skipped = skip_counts_text(self.encoder.skips.metrics())
        if len(self.train) < self.d.prompts_per_step:
            raise DataError(f"{self.files['train']}: {len(self.train)} valid records, fewer than one step's "
                            f"data.prompts_per_step={self.d.prompts_per_step} (skipped: {skipped})")
        for eval_set in self.eval_sets:
            if not eval_set.records:
                raise DataError(f"eval set {eval_set.name!r} ({self.files['eval']}): no valid record "
                                f"(skipped: {skipped})")

    def skip_vector(self) -> list[float]:
        """The skip counts summed over data-parallel ranks (collective)."""
        return self.dp.sums(self.encoder.skips.vector())

    def skip_metrics(self) -> dict[str, float]:
        """skipped/<phase>/<reason> over the job (collective)."""
        return self.encoder.skips.metrics(self.skip_vector())

    def no_valid_sample(self, phase: str) -> DataError:
        return DataError(f"a {phase} step has no valid sample: every record of its batch was skipped "
                         f"({self.files.get('train' if phase == 'warmup' else phase, '?')}; skipped so far: "
                         f"{skip_counts_text(self.skip_metrics())})")
