"""Will a Hugging Face fine-tune fit? lit_speed.run.memory_fit.fit_check: the estimate's parts, the refusal before loading, and
(slow tier) the predicted peak RSS against the measured one on a ~50M-parameter model."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from lit_speed.memory.rss_estimate import RSSEstimate  # noqa: E402
from lit_speed.run.config_error import ConfigError  # noqa: E402
from lit_speed.run.memory_fit import fit_check, fit_check_gpu, fit_gate, fit_levers  # noqa: E402
from lit_speed.run.runner import train  # noqa: E402
from tests.helpers.repo import ROOT  # noqa: E402
from tests.helpers.tiny_hf import save_tiny_causal_lm, write_texts  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "tiny_qwen2", "qwen2", seed=0)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_texts(tmp_path_factory.mktemp("texts"))


def _args(folder, texts, *extra):
    return ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={texts}",
            "data.block_size=32", "data.batch_size=4", "data.val_every=3", "trainer.max_steps=2", "logger=none",
            "callbacks=none", "validate=false", "trainer.enable_progress_bar=false", *extra]


def test_the_estimate_counts_every_parameter_and_the_levers_move_it_the_right_way(make_cfg, folder, texts):
    cfg = make_cfg(_args(folder, texts, "peft=none"))
    full = fit_check.estimate_run(cfg, process_bytes=0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    n = sum({id(p): p.numel() for p in model.parameters()}.values())  # tied embeddings once
    assert full.weights == 4 * n and full.optimizer == 8 * n  # float32 weights, AdamW's two float32 moments
    assert full.step > 0 and full.peak >= full.training_peak > 0
    configured = fit_levers.configured_levers(cfg)
    lora = fit_check.estimate_run(cfg, replace(configured, lora=True, base_bf16=True), process_bytes=0)
    assert lora.weights < 0.7 * full.weights and lora.optimizer < full.optimizer / 4  # tiny: r=8 is large here
    small = fit_check.estimate_run(cfg, replace(configured, micro_batch=1), process_bytes=0)
    assert small.step < full.step


def test_the_probe_steps_a_model_tied_as_the_folder_and_autocast_as_the_run(make_cfg, folder, texts, monkeypatch):
    # the probe's copies are built without initialisation, which skipped the tying (an untied head has no summed
    # gradient of its two uses: 0.5B full fine-tuning's step x0.88 of the run's); its autocast kept a bf16 copy of
    # every weight it cast (cache_enabled, which the run's precision plugin turns off: the forward x1.7 of the run's)
    from lit_speed.memory import rss_estimate

    seen = {}
    measure = rss_estimate.probe_scaled

    def probe_scaled(build, step, autocast, **kwargs):
        small = build(1, 64)
        seen["tied"] = small.model.lm_head.weight is small.model.model.embed_tokens.weight
        with autocast():
            seen["cache"] = torch.is_autocast_cache_enabled()
            seen["autocast"] = torch.is_autocast_enabled("cpu")
        return measure(build, step, autocast, **kwargs)

    monkeypatch.setattr(rss_estimate, "probe_scaled", probe_scaled)
    fit_check.estimate_run(make_cfg(_args(folder, texts, "peft=none", "precision=bf16-mixed")), process_bytes=0)
    assert seen == {"tied": True, "cache": False, "autocast": True}


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_the_weights_load(make_cfg, folder, texts, monkeypatch):
    # a stand-in estimate (GiB by lever set) on a machine with 8 GiB free: the real estimate of a tiny model always
    # fits; what is tested is the decision, the message and that nothing was loaded
    gib = 2**30
    peaks = {False: 30 * gib, True: 6 * gib}  # full fine-tuning / LoRA

    def estimate(cfg, levers=None, process_bytes=None, facts=None, cache=None):
        levers = levers or fit_levers.configured_levers(cfg)
        return RSSEstimate(process=gib, weights=peaks[levers.lora] - gib, optimizer=0, step=0, optimizer_step=0,
                           load=0, slack=1.0)

    monkeypatch.setattr(fit_check, "estimate_run", estimate)
    monkeypatch.setattr(fit_check, "generous_bound", lambda facts, process: 10**15)
    memory = collections.namedtuple("Memory", "available total percent")
    monkeypatch.setattr("psutil.virtual_memory", lambda: memory(8 * gib, 24 * gib, 66.0))

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were read before the refusal")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
    with pytest.raises(ConfigError) as refused:
        train(make_cfg(_args(folder, texts, "peft=none")))
    message = str(refused.value)
    assert "\n" not in message and "needs about 30.00 GiB" in message and "GiB is there" in message
    # the levers before LoRA (cheaper in speed) are added on the way; the set that fits is named whole (the chunked
    # loss is on already: conf/model/hf_causal_lm.yaml's loss_chunk_mib)
    assert "Fix: 'callbacks=[activation_checkpointing]' peft=lora peft.base_dtype=bf16 (predicted 6.00 " \
           "GiB); scripts/plan.py shows every option" in message


def test_a_run_nothing_makes_fit_names_the_remaining_fixes(make_cfg, folder, texts, monkeypatch):
    gib = 2**30
    monkeypatch.setattr(fit_check, "estimate_run", lambda cfg, levers=None, process_bytes=None, facts=None, cache=None: RSSEstimate(
        process=gib, weights=40 * gib, optimizer=0, step=0, optimizer_step=0, load=0, slack=1.0))
    monkeypatch.setattr(fit_check, "generous_bound", lambda facts, process: 10**15)
    with pytest.raises(ConfigError, match=r"no lever set fits .* Fix: a smaller model, data.block_size"):
        fit_gate.check_fits_memory(make_cfg(_args(folder, texts, "peft=none")), available_bytes=8 * gib)


def test_a_probe_that_cannot_run_warns_and_lets_the_run_go_on(make_cfg, folder, texts, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("stand-in probe failure")

    monkeypatch.setattr(fit_check, "estimate_run", broken)
    monkeypatch.setattr(fit_check, "generous_bound", lambda facts, process: 10**15)
    with pytest.warns(UserWarning, match="the memory estimate could not run .*stand-in probe failure"):
        fit_gate.check_fits_memory(make_cfg(_args(folder, texts, "peft=none")), available_bytes=1)


def test_a_gpu_run_is_judged_by_its_host_side_not_by_the_cpu_step(make_cfg, folder, texts, monkeypatch):
    # found on an H200: the CPU step's estimate does not apply to a run whose step is on the GPU; what the host holds
    # is the weights while loading and, at the end of fit, the weights and the optimizer state that Lightning's
    # teardown moves back to the CPU (+6 GB at 0.5B full fine-tuning)
    from transformers import AutoModelForCausalLM

    def cpu_estimate(*args, **kwargs):
        raise AssertionError("the CPU step's estimate was used for a GPU run")

    monkeypatch.setattr(fit_check, "estimate_run", cpu_estimate)
    monkeypatch.setattr(fit_check, "generous_bound", lambda facts, process: 10**15)  # would probe on a CPU run
    gpu = make_cfg(_args(folder, texts, "peft=none", "trainer=gpu"))
    assert fit_check_gpu.trains_on_gpu(gpu) and not fit_check_gpu.trains_on_gpu(make_cfg(_args(folder, texts)))
    fit_gate.check_fits_memory(gpu, available_bytes=8 * 2**30)  # the tiny model's host side fits: no refusal
    model = AutoModelForCausalLM.from_pretrained(folder)
    n = sum({id(p): p.numel() for p in model.parameters()}.values())
    facts = fit_check.run_facts(gpu, folder, fit_levers.configured_levers(gpu))
    load, end = fit_check_gpu.gpu_run_host_bytes(gpu, facts, fit_levers.configured_levers(gpu))
    export = fit_check.export_bytes(gpu, facts, fit_levers.configured_levers(gpu))
    assert end == 4 * n + 8 * n + export and load >= 4 * n  # float32 weights and AdamW's two moments, then the export
    with pytest.raises(ConfigError, match=r"this run trains on the GPU and needs about .* of host RAM at its peak "
                                          r"\(loading the weights .*Lightning's teardown moves the weights and the "
                                          r"optimizer state to the CPU.*Fix: peft=lora"):
        fit_gate.check_fits_memory(gpu, available_bytes=1)


def test_on_one_gpu_the_step_is_judged_against_the_devices_free_memory(make_cfg, folder, texts, monkeypatch):
    # no GPU here: the device's free memory is given (gpu_free_bytes stands in for torch.cuda.mem_get_info); the
    # prediction is the CPU probe's (eager, the run's precision under autocast), checked on an H200 in RESULTS.md
    monkeypatch.setattr(fit_check, "generous_bound", lambda facts, process: 10**15)  # always probe
    gpu = make_cfg(_args(folder, texts, "peft=none", "trainer=gpu", "precision=bf16-mixed"))
    estimate = fit_check.estimate_run(gpu, process_bytes=0)
    need = fit_check_gpu.gpu_step_bytes(estimate)
    assert need == int((estimate.weights + estimate.optimizer + max(estimate.step, estimate.optimizer_step))
                       * fit_check_gpu.GPU_SLACK) and estimate.weights > 0 and estimate.step > 0
    fit_gate.check_fits_memory(gpu, available_bytes=8 * 2**30, gpu_free_bytes=need)  # exactly enough: runs
    lora = fit_check.estimate_run(gpu, replace(fit_levers.configured_levers(gpu), lora=True), process_bytes=0)
    assert fit_check_gpu.gpu_step_bytes(lora) < need
    with pytest.raises(ConfigError, match=r"this run's step needs about .* of GPU memory \(weights .*, optimizer "
                                          r".*, step .*\), cuda:0 has .* free\. Fix: .* \(predicted .*\)"):
        fit_gate.check_fits_memory(gpu, available_bytes=8 * 2**30, gpu_free_bytes=need - 1)
    with pytest.raises(ConfigError, match=r"GPU memory .* and no lever set fits .* a GPU with more memory"):
        fit_gate.check_fits_memory(gpu, available_bytes=8 * 2**30, gpu_free_bytes=1)
    cpu = make_cfg(_args(folder, texts, "peft=none"))
    fit_gate.check_fits_memory(cpu, available_bytes=8 * 2**30, gpu_free_bytes=1)  # a CPU run: no GPU judged


@pytest.mark.parametrize("extra, device", [(["trainer=gpu"], 0), (["trainer=gpu", "trainer.devices=[3]"], 3),
                                           (["trainer=gpu", "trainer.devices=2"], None),
                                           (["trainer=gpu", "trainer.num_nodes=2"], None),
                                           (["trainer=gpu", "strategy=zero2"], None),
                                           (["trainer=gpu", "strategy=ddp"], None), ([], None)])
def test_the_gpu_side_is_judged_for_one_process_on_one_gpu_only(make_cfg, folder, texts, extra, device):
    assert fit_check_gpu.gpu_to_judge(make_cfg(_args(folder, texts, *extra))) == device


ACCURACY_SCRIPT = r"""
import json, resource, sys
from lit_speed.run.config_check import preflight
from lit_speed.run.memory_fit import fit_check, fit_levers
from lit_speed.run.runner import train
cfg = preflight(sys.argv[1:])
import psutil
levers = fit_levers.configured_levers(cfg)
bound = fit_check.generous_bound(fit_check.run_facts(cfg, fit_check.hf_folder(cfg), levers),
                                 psutil.Process().memory_info().rss)
estimate = fit_check.estimate_run(cfg)
train(cfg)
print("RESULT " + json.dumps({"predicted": estimate.peak, "parts": estimate.parts(), "bound": bound,
                              "measured": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _qwen2_50m(folder):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.helpers.tiny_hf import tiny_tokenizer

    config = Qwen2Config(vocab_size=32_000, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert 45e6 < sum(p.numel() for p in model.parameters()) < 100e6
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


GPU_ACCURACY_SCRIPT = r"""
import json, sys, torch
from lit_speed.run.config_check import preflight
from lit_speed.run.memory_fit import fit_check, fit_levers
from lit_speed.run.runner import train
cfg = preflight(sys.argv[1:])
estimate = fit_check.estimate_run(cfg, process_bytes=0)
train(cfg)
print("RESULT " + json.dumps({"predicted": estimate.tensors, "parts": estimate.parts(),
                              "measured": torch.cuda.max_memory_allocated()}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU step's measured peak")
@pytest.mark.parametrize("extra", [["peft=none"], ["peft=lora"]])
def test_on_a_gpu_the_predicted_step_is_within_15_percent_of_the_measured_peak(tmp_path, texts, extra):
    # the GPU side of the fit check as the runner makes it (the CPU probe in bf16-mixed, eager) against
    # torch.cuda.max_memory_allocated of the same run (no callback resets it: callbacks=none)
    folder = _qwen2_50m(tmp_path / "qwen2_50m")
    args = ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={texts}",
            "data.block_size=256", "data.batch_size=4", "trainer.max_steps=3", "logger=none", "callbacks=none",
            "validate=false", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0",
            "trainer.num_sanity_val_steps=0", "trainer=gpu", "precision=bf16-mixed", *extra,
            f"hydra.run.dir={tmp_path / 'run'}", f"paths.output_dir={tmp_path / 'run'}"]
    done = subprocess.run([sys.executable, "-c", GPU_ACCURACY_SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert 0.85 <= result["predicted"] / result["measured"] <= 1.15, json.dumps(result)


@pytest.fixture(scope="module")
def qwen2_50m(tmp_path_factory):
    return _qwen2_50m(tmp_path_factory.mktemp("qwen2_50m"))


#: The memory levers, one at a time, on the 52M model (issue 50 item 3), freed memory returned to the system: the
#: chunked loss is on in every row (the model option's default) except ``plain_loss``. ``keep_freed`` is a Hugging
#: Face run's default: what glibc keeps is not predicted (x1.22-1.86 of the tensors, varying run to run), only bounded.
#: On XA (2026-12-01): x1.00-1.04, the lowered bases x1.00 / x1.03 (x0.87 / x0.88 while the float32 file they were
#: read from stayed mapped: frozen_base._copy_out_of_file_maps).
LEVER_ROWS = {
    "full": ["peft=none"],
    "lora": ["peft=lora"],
    "lora_bf16_base": ["peft=lora", "peft.base_dtype=bf16"],
    "lora_int8_base": ["peft=lora", "peft.base_dtype=int8"],
    "plain_loss": ["peft=none", "model.loss_chunk_mib=null"],
    "checkpointing": ["peft=none", "callbacks=[activation_checkpointing,return_freed_memory]"],
    "states_8bit": ["peft=none", "optimizer=adamw8bit"],
    "keep_freed": ["peft=lora", "callbacks=[keep_freed_memory]"],
}


@pytest.mark.slow
@pytest.mark.parametrize("row", list(LEVER_ROWS))
def test_the_predicted_peak_rss_is_within_15_percent_of_the_measured_one_on_a_50m_parameter_model(tmp_path, texts,
                                                                                                  qwen2_50m, row):
    # the estimate as the runner makes it (in the training process, before the weights load) against that process's
    # peak RSS, for each memory lever
    lever = LEVER_ROWS[row]
    callbacks = [] if any(a.startswith("callbacks=") for a in lever) else ["callbacks=[return_freed_memory]"]
    args = ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={qwen2_50m}", f"data.root={texts}",
            "data.block_size=256", "data.batch_size=4", "data.val_every=3", "trainer.max_steps=3", "logger=none",
            *callbacks, "validate=false", "trainer.enable_progress_bar=false", *lever,
            "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", f"hydra.run.dir={tmp_path / 'run'}",
            f"paths.output_dir={tmp_path / 'run'}"]
    done = subprocess.run([sys.executable, "-c", ACCURACY_SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["bound"] >= result["measured"], json.dumps(result)  # the config-only bound that skips the probe
    if row == "keep_freed":  # what glibc keeps comes on top of the prediction (its bound, kept_peak: the benchmark's)
        assert result["parts"]["peak"] <= result["measured"], json.dumps(result)
        return
    ratio = result["predicted"] / result["measured"]
    assert 0.85 <= ratio <= 1.15, json.dumps(result)


@pytest.mark.slow
def test_plan_script_prints_the_predicted_peak_rss_of_every_lever_set_for_a_hugging_face_folder(folder, texts):
    args = [sys.executable, "scripts/plan.py", *_args(folder, texts, "peft=none")]
    fits = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "predicted peak RSS" in fits.stdout and "cheapest that fits: #0: (as configured)" in fits.stdout
    assert "#4: " in fits.stdout and "peft=lora peft.base_dtype=bf16" in fits.stdout  # the LoRA row's overrides
    nothing = subprocess.run([*args, "--budget-mib", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert nothing.returncode == 1 and "Nothing fits" in nothing.stdout, nothing.stdout[-2000:]


@pytest.mark.slow
def test_plan_script_shows_the_gpu_step_of_a_gpu_run_against_budget_mib(folder, texts):
    args = [sys.executable, "scripts/plan.py",
            *_args(folder, texts, "peft=none", "trainer=gpu", "precision=bf16-mixed")]
    wide = {**os.environ, "COLUMNS": "200"}
    fits = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=wide)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "GPU GiB" in fits.stdout and "budget unknown here" in fits.stdout, fits.stdout[-2000:]
    tight = subprocess.run([*args, "--budget-mib", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=wide)
    assert tight.returncode == 0 and "cheapest that fits: #0" not in tight.stdout, tight.stdout[-2000:]
    assert "cheapest that fits: #" in tight.stdout  # a lever set that puts the tiny step under 2 MiB


def test_the_adapter_settings_are_read_without_resolving_the_other_peft_keys():
    # plan.py composes the config outside a Hydra run: peft.export_dir's ${hydra:...} cannot resolve there, and
    # resolving the whole peft node made `scripts/plan.py ... peft=lora` end in an InterpolationResolutionError
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"peft": {"_target_": "lit_speed.finetune.PEFTAdapters", "method": "lora", "r": 8,
                                     "target_modules": ["q_proj", "${peft.extra}"], "extra": "v_proj",
                                     "export_dir": "${hydra:runtime.output_dir}/merged"}})
    args = fit_check._adapter_args(cfg, lora=True)
    assert args == {"method": "lora", "r": 8, "target_modules": ["q_proj", "v_proj"]}


def test_the_merged_export_is_counted_when_the_run_writes_one(make_cfg, folder, texts):
    from transformers import AutoModelForCausalLM

    from lit_speed.finetune.export import EXPORT_SHARD_BYTES

    cache: dict = {}  # one probe for the three: they differ only in the export
    exporting = fit_check.estimate_run(make_cfg(_args(folder, texts, "peft=lora")), process_bytes=0, cache=cache)
    silent = fit_check.estimate_run(make_cfg(_args(folder, texts, "peft=lora", "peft.export=false")), process_bytes=0,
                                    cache=cache)
    model = AutoModelForCausalLM.from_pretrained(folder)
    n = sum({id(p): p.numel() for p in model.parameters()}.values())
    linear = max(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # tiny: the whole float32 model is under one shard, so all of it, and the last LoRA layer's merge (three weights
    # more at most: B @ A, its scaled copy, the finite check)
    assert 4 * n < exporting.export <= 4 * (n + 3 * linear) < EXPORT_SHARD_BYTES
    assert exporting.export_peak > exporting.process and silent.export == silent.export_peak == 0
    assert exporting.step == silent.step  # the same probe


def test_larger_loss_chunks_than_the_probes_are_counted_in_the_step():
    """The probe chunks at the default 128 MiB; chunk_mib=auto may pick up to 4x as many tokens (Qwen2.5's vocabulary:
    880 instead of 220), and the step term grows by their logits; a smaller vocabulary's one chunk adds nothing."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    def cfg(chunk):
        callbacks = {} if chunk is None else {"chunked_loss": {
            "_target_": "lit_speed.memory.chunked_lm_loss_callback.ChunkedLMLoss", "chunk_mib": chunk}}
        return OmegaConf.create({"callbacks": callbacks, "model": {}})

    def facts(vocab):
        return SimpleNamespace(vocab=vocab, precision="32-true", config=SimpleNamespace(hidden_size=896))

    levers = fit_levers.Levers(chunked_loss=True)
    assert fit_levers.loss_chunk_mib(cfg("auto")) == "auto" and fit_levers.loss_chunk_mib(cfg(64)) == 64.0
    assert fit_check._chunk_extra(cfg("auto"), facts(151_936), levers, 2048) == (880 - 220) * 151_936 * 4
    assert fit_check._chunk_extra(cfg(None), facts(151_936), levers, 2048) == (880 - 220) * 151_936 * 4  # the default
    assert fit_check._chunk_extra(cfg(128), facts(151_936), levers, 2048) == 0
    assert fit_check._chunk_extra(cfg(512), facts(151_936), levers, 512) == (512 - 220) * 151_936 * 4
    assert fit_check._chunk_extra(cfg("auto"), facts(151_936), levers, 200) == 0  # one chunk either way
    assert fit_check._chunk_extra(cfg("auto"), facts(32_000), levers, 1024) == 0


@pytest.mark.parametrize("overrides", [["peft=none"], ["peft=lora", "callbacks=[chunked_loss,activation_checkpointing]"],
                                       ["peft=lora", "peft.base_dtype=bf16", "precision=bf16-mixed"]],
                         ids=["full", "lora-chunked-checkpointed", "lora-bf16-base-autocast"])
def test_the_probe_measures_the_same_bytes_without_computing_the_products(make_cfg, folder, texts, overrides):
    """The probe's matmuls return zeros of their shape (memory_tracker.SkipMatmuls): at 0.5B dims they were most of
    the fit check's time (the LM head at the real vocabulary). The bytes it measures are the same as computing them."""
    cfg = make_cfg(_args(folder, texts, *overrides))
    levers = fit_levers.configured_levers(cfg)
    facts = fit_check.run_facts(cfg, fit_check.hf_folder(cfg), levers)
    skipped = fit_check._probe(cfg, facts, levers)
    computed = fit_check._probe(cfg, facts, levers, skip_matmuls=False)
    assert skipped[0] == computed[0] and skipped[0].step_bytes(24, facts.vocab, 2048) > 0


def test_the_probes_models_are_freed_when_the_estimate_returns(make_cfg, folder, texts):
    """The probe's models sit in reference cycles (adapters, hooks), which only the cycle collector frees: before,
    they lived on through the run's load and steps until its next full pass (1B-dims LoRA preset: 2.3 GiB of RSS)."""
    import gc

    from transformers import PreTrainedModel

    def models() -> int:
        return sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())

    cfg = make_cfg(_args(folder, texts, "peft=lora"))
    gc.collect()
    before = models()
    gc.disable()  # no automatic pass: what is left alive is what the estimate left
    try:
        assert fit_check.estimate_run(cfg, process_bytes=0) is not None
        assert models() == before
    finally:
        gc.enable()


def test_the_estimate_of_this_process_counts_its_probes_own_peak(make_cfg, folder, texts):
    import psutil

    cfg = make_cfg(_args(folder, texts, "peft=lora"))
    estimate = fit_check.estimate_run(cfg)
    assert estimate.check >= psutil.Process().memory_info().rss * 0.5 and estimate.peak >= estimate.check
    assert fit_check.estimate_run(cfg, process_bytes=0).check == 0  # the tensors alone


def test_glibc_keeping_freed_memory_is_bounded_and_left_out_of_the_peak(make_cfg, folder, texts, monkeypatch):
    """KeepFreedMemory (a Hugging Face run's default) keeps freed blocks in glibc's heaps: x1.22-1.86 of the tensors'
    peak, varying from run to run (bench_plan_accuracy.py, the 52M rows). Not predicted: an upper bound beside the peak, which the
    fit check judges (the callback hands that memory back when available memory runs short)."""
    from lit_speed.memory.rss_estimate import KEEP_SLACK

    libc = types.SimpleNamespace(malloc_trim=lambda pad: 1)  # glibc, whatever this machine's C library is
    monkeypatch.setattr("lit_speed.memory.allocator.glibc", lambda: libc)
    args = [a for a in _args(folder, texts, "peft=lora") if a != "callbacks=none"]
    default = make_cfg([*args, "callbacks=[model_checkpoint]"])
    assert fit_levers.keeps_freed_memory(default)  # added by scripts/train.py to a Hugging Face run
    assert fit_levers.keeps_freed_memory(make_cfg([*args, "callbacks=[keep_freed_memory]"]))
    assert not fit_levers.keeps_freed_memory(make_cfg([*args, "callbacks=[return_freed_memory]"]))
    assert not fit_levers.keeps_freed_memory(make_cfg(["callbacks=[model_checkpoint]"]))  # digits: not a HF run
    kept = fit_check.estimate_run(default, process_bytes=0)
    returned = fit_check.estimate_run(make_cfg([*args, "callbacks=[return_freed_memory]"]), process_bytes=0)
    assert kept.peak == returned.peak == returned.kept_peak
    assert kept.kept_peak == max(kept.peak, int(kept.tensors * KEEP_SLACK)) > kept.peak
    monkeypatch.setattr("lit_speed.memory.allocator.glibc", lambda: None)  # another C library: the callback is a no-op
    assert not fit_levers.keeps_freed_memory(default)



def test_the_generous_bound_is_above_the_probes_estimate_for_every_lever_set(make_cfg, folder, texts):
    """The config-only bound skips the probe when it fits: it must stay above what the probe would predict (the
    slow 50M test also checks it against the measured peak)."""
    cfg = make_cfg(_args(folder, texts, "peft=none"))
    configured = fit_levers.configured_levers(cfg)
    for levers in fit_levers.lever_sets(configured, True):
        facts = fit_check.run_facts(cfg, fit_check.hf_folder(cfg), levers)
        estimate = fit_check.estimate_run(cfg, levers, process_bytes=0, facts=facts)
        assert fit_check.generous_bound(facts, 0) >= estimate.peak, levers
