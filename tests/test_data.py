"""The embedded real-text data: standard library sources as byte tokens, with a held-out split."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.cli.data import ByteTextDataset, load_text_splits, stdlib_source_files


def test_stdlib_sources_are_found_in_a_fixed_order():
    files = stdlib_source_files()
    assert len(files) > 50
    assert files == sorted(files)
    assert all(f.suffix == ".py" for f in files)


def test_train_and_validation_splits_are_real_text_and_disjoint_files():
    splits = load_text_splits(max_bytes=2 * 2**20, valid_fraction=0.1)
    assert splits.train.dtype == torch.uint8
    assert splits.train.numel() > 5 * splits.valid.numel()
    text = bytes(splits.train[:20000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import" in text
    # Whole files are held out: the validation text does not start inside the training text.
    probe = splits.valid[:200].numpy().tobytes()
    assert probe not in splits.train.numpy().tobytes()


def test_samples_are_shifted_windows_in_gpt_dataset_format():
    tokens = torch.arange(100, dtype=torch.uint8)
    dataset = ByteTextDataset(tokens, seq_length=8, num_samples=30)
    assert len(dataset) == 30
    sample = dataset[1]
    assert sample["tokens"].tolist() == list(range(8, 16))
    assert sample["labels"].tolist() == list(range(9, 17))
    assert sample["loss_mask"].shape == (8,) and sample["position_ids"].tolist() == list(range(8))
    # wraps around after (100 - 1) // 8 = 12 windows
    assert dataset[12]["tokens"].tolist() == dataset[0]["tokens"].tolist()


def test_a_user_text_file_and_bad_inputs(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world, " * 100)
    splits = load_text_splits(path, valid_fraction=0.2)
    assert splits.train.numel() + splits.valid.numel() == 1300
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_text_splits(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="valid_fraction"):
        load_text_splits(path, valid_fraction=1.5)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        ByteTextDataset(torch.zeros(4, dtype=torch.uint8), seq_length=8)


def test_a_fixed_validation_set_repeats_the_same_spread_out_windows_every_evaluation():
    tokens = torch.arange(200, dtype=torch.uint8)  # 24 windows of 8
    dataset = ByteTextDataset(tokens, seq_length=8, num_samples=18, fixed_windows=6)
    first = [dataset[i]["tokens"][0].item() for i in range(6)]
    assert first == [0, 32, 64, 96, 128, 160]  # every 4th window: the whole split is read
    # the second and third evaluations (samples 6-11, 12-17) read the same windows, in order
    assert [dataset[i]["tokens"][0].item() for i in range(6, 18)] == first * 2
    assert ByteTextDataset(tokens, seq_length=8, fixed_windows=100).num_windows == 24
    with pytest.raises(ValueError, match="fixed_windows"):
        ByteTextDataset(tokens, seq_length=8, fixed_windows=0)


def test_shuffled_windows_are_a_seeded_permutation_of_the_stream():
    tokens = torch.arange(200, dtype=torch.uint8)
    starts = [ByteTextDataset(tokens, 8, shuffle_seed=seed) for seed in (1, 1, 2)]
    orders = [[d[i]["tokens"][0].item() for i in range(len(d))] for d in starts]
    assert orders[0] == orders[1] != orders[2]  # the same on every rank for one seed
    assert sorted(orders[0]) == list(range(0, 192, 8)) != orders[0]
