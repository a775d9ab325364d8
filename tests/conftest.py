"""Tests run on 8 simulated CPU devices; the flag must be set before JAX starts its backend."""
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Cheaper LLVM code generation: compiles ~3x faster on 2 cores. It does not change the HLO passes (so the
# collective tallies are the same); at level 0 the initialiser's truncated normals differ from a default
# run's in their last bits (tests/test_xla_workarounds.py), the same in every test and its reference.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import pytest  # noqa: E402

from tests import harness  # noqa: E402

# `make test` runs two pytest-xdist workers, each taking one test file at a time (--dist loadfile) in
# collection order (--no-loadscope-reorder: xdist would otherwise order files by their number of tests): the
# longest files go first (longest-processing-time-first), so that neither worker is left with a long file at
# the end. Ordered by seconds on a 2-core machine (`pytest --durations=0`, summed per file).
LONGEST_FIRST = ("test_strategies.py", "test_pipeline.py", "test_cost_vs_xla.py", "test_multiprocess.py",
                 "test_moe.py", "test_inference.py", "test_attention_kernels.py", "test_cost_vs_hlo.py",
                 "test_experiments_study.py", "test_mamba_ops.py", "test_planner.py", "test_verify_scale.py",
                 "test_mamba_model.py", "test_comm.py", "test_context_parallel.py", "test_xla_workarounds.py",
                 "test_checkpoint.py", "test_context_model.py", "test_moe_grouped.py",
                 "test_experiments_bench.py", "test_collective_matmul.py", "test_pipeline_moe.py",
                 "test_remat.py", "test_fsdp_prefetch.py", "test_bad_input_35.py", "test_faults_scale.py",
                 "test_hf_moe.py", "test_training.py", "test_fuzz.py", "test_tpu_compile.py",
                 "test_cli_run.py", "test_inference_layouts.py", "test_generate_bf16.py", "test_explain.py",
                 "test_checkpoint_cli.py", "test_data_loader.py", "test_package.py")

# Cases behind -m slow to keep `make test` under its 600 s budget on 2 cores: each compiles for 12 to 28 s,
# and what it checks is also checked, in a cheaper form, by a case that stays (another layout of the same
# kind, or the same property on a smaller model). `make test-slow` runs them; CI runs it after `make test`.
# Matched against the start of each test's id (file::name[params]).
SLOW_IDS = (
    "test_checkpoint_cli.py::test_stop_and_resume_in_a_fresh_process_is_bitwise_identical",
    "test_checkpoint_cli.py::test_killed_during_a_save_resumes_from_the_last_complete_checkpoint",
    "test_checkpoint_cli.py::test_killed_mid_training_loses_at_most_k_plus_one_steps",
    "test_moe.py::test_model_matches_one_device[moe-tiny:shared_experts=2",
    "test_moe.py::test_model_matches_one_device[moe-tiny:capacity_factor=1.0-data=2,expert=4",
    "test_moe.py::test_model_matches_one_device[moe-tiny:capacity_factor=1.0-context=2,expert=4",
    "test_moe.py::test_training_writes_router_metrics",
    "test_xla_workarounds.py::test_top_k_keeps_the_router_scores_batch_sharded",
    "test_pipeline.py::test_head_flops_once_per_step",
    "test_pipeline.py::test_uneven_circular_schedule_forward",
    "test_training.py::test_gradient_accumulation_equals_the_full_batch",
    "test_pipeline_moe.py::test_loss_gradients_and_router_metrics_match_one_device[gpipe-uneven-ep2-dp2]",
    "test_verify_scale.py::test_context_pipeline_sums_over_data_once",
    "test_verify_scale.py::test_data_pipeline_reduces_over_data_once_and_equals_one_device[1]",
    "test_verify_scale.py::test_data_fsdp_pipeline_reduces_over_data_once_and_equals_one_device",
    "test_cost_vs_hlo.py::test_pipeline_context_prediction_equals_hlo",
    "test_experiments_bench.py::test_quick_mode[demo]",
    "test_experiments_study.py::test_quick_mode[study_zero_stages]",
    "test_inference_layouts.py::test_prefill_on_context_then_decode_on_tensor",
    "test_inference.py::test_greedy_generation_matches_the_unsharded_forward[hybrid-tiny:ngroups=8-tensor=8",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[llama-tiny-cp8-ring]",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[moe-tiny:d_model=128",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[mamba2-tiny-fsdp8]",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[moe-tiny-ep8]",
    "test_multiprocess.py::test_comm_under_two_processes",
    "test_multiprocess.py::test_sigterm_saves_a_checkpoint_and_stops_everything",
    "test_comm.py::test_compare_trains_and_plots",
    "test_multiprocess.py::test_an_unexpected_error_in_one_process_stops_the_run_at_once",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[mamba2-tiny-dp8]",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[llama-tiny-tp8]",
    "test_cost_vs_xla.py::test_flops_per_device_match_xla[llama-tiny-fsdp8]",
    "test_strategies.py::test_tensor_beyond_kv_heads_replicates_them_and_matches_one_device",
    "test_mamba_model.py::test_matches_one_device[mamba2-tiny-data=8-8",
    "test_inference.py::test_greedy_generation_matches_the_unsharded_forward[mamba2-tiny-data=4,tensor=2",
    "test_moe.py::test_comm_reports_the_all_to_alls_per_moe_layer",
    "test_experiments_study.py::test_quick_mode[study_moe]",
    "test_experiments_study.py::test_quick_mode[study_scaling_ladder]",
    "test_experiments_bench.py::test_quick_mode[bench_inference]",
    "test_training.py::test_bfloat16_compute_stays_close_and_keeps_float32_masters",
    "test_training.py::test_hundred_steps_halve_the_loss",
    "test_attention_kernels.py::test_blockwise_memory_grows_linearly_dense_quadratically",
    "test_attention_kernels.py::test_blockwise_strategy_matches_one_device[tp4-sp]",
    "test_gpu_check.py::test_dry_run_writes_every_section_with_numbers",
    "test_gpu_check.py::test_checkout_packages_registered_without_an_install",
    # the same rule, for this session's additions (checked cheaper by the cases named beside them)
    "test_checkpoint_cli.py::test_a_finished_run_a_fresh_run_and_overwrite",       # test_bad_input_35's refusals
    "test_checkpoint_cli.py::test_a_damaged_newest_checkpoint",                     # test_checkpoint_integrity
    "test_checkpoint_cli.py::test_sigterm_saves_at_the_end_of_the_step",            # ...without_a_checkpoint_directory
    "test_pipeline.py::test_1f1b_head_flops_once_per_step[S2-M4-1f1b-cp2-ring]",    # the other 1F1B cases
    "test_pipeline.py::test_1f1b_head_flops_once_per_step[U10-S2-M4-1f1b-v2-tp2-sp]",
    "test_pipeline.py::test_loss_and_gradients_match_one_device[S4-M8-1f1b-v2-dp2]",   # interleaved: head-flops cases
    "test_pipeline.py::test_loss_and_gradients_match_one_device[S4-M4-circular-fsdp2]",  # ...circular-tp2-sp-remat
    "test_pipeline.py::test_loss_and_gradients_match_one_device[U10-S4-M4-1f1b-fsdp2]",  # the other 1F1B layouts
    "test_pipeline.py::test_loss_and_gradients_match_one_device[U10-S4-M2-gpipe-fsdp2]",
    "test_strategies.py::test_loss_and_gradients_match_one_device[dp2-ep4]",         # ep8, ep4-tp2
    "test_strategies.py::test_loss_and_gradients_match_one_device[fsdp2-ep4]",
    "test_strategies.py::test_loss_and_gradients_match_one_device[pp2-tp2-dp2]",     # pp4-dp2, pp4-circular
    "test_strategies.py::test_training_trajectory_matches_one_device[cp4-tp2-ring]",  # cp8-ring's trajectory
    # the 600 s budget again, after the design guide's studies and the stacks' pipeline x context search grew
    "test_pipeline.py::test_pipeline_collectives_as_predicted[S4-M8-1f1b-v2-dp2]",      # the other three layouts
    "test_pipeline.py::test_loss_and_gradients_match_one_device[S2-M8-1f1b-tp2-sp-dp2]",  # S4-M4-1f1b-remat-full
    "test_mamba_model.py::test_matches_one_device[mamba2-tiny-fsdp=8-8-options1]",      # context=4, data x context x tensor
    "test_moe.py::test_model_matches_one_device[moe-tiny-data=4,tensor=2-8-options3]",  # test_strategies' ep4-tp2
    "test_checkpoint.py::test_restore_onto_another_mesh_gives_the_same_next_step[zero1-dp8-8-fsdp8-8]",  # tp8, dp2-tp4
    "test_checkpoint.py::test_restore_onto_another_mesh_gives_the_same_next_step[fsdp8-8-cp8-ring-8]",
    "test_strategies.py::test_training_trajectory_matches_one_device[fsdp2-ep4]",       # ep8's trajectory
    "test_strategies.py::test_loss_and_gradients_match_one_device[pp4-circular]",       # test_pipeline's circular cases
    "test_cost_vs_xla.py::test_memory_per_device_matches_xla[moe-tiny:d_model=128",     # moe-tiny-ep8
    "test_pipeline.py::test_pipeline_collectives_as_predicted[U10-S4-M2-gpipe-fsdp2]",  # S4-M4-circular-fsdp2
    "test_mamba_model.py::test_matches_one_device[mamba2-tiny-context=4-4-options4]",   # data x context x tensor
    "test_checkpoint.py::test_restore_onto_another_mesh_gives_the_same_next_step[tp8-8-data=1-1]",  # dp2-tp4
    "test_experiments_bench.py::test_quick_mode[bench_overlap]",                        # test_cost_overlap, test_collective_matmul
    "test_experiments_study.py::test_quick_mode[study_long_context]",                   # test_context_model, study_mfu_map (CP at 128k)
    "test_strategies.py::test_training_trajectory_matches_one_device[dp2-ep4]",
    "test_strategies.py::test_training_trajectory_matches_one_device[dp2-cp4-zigzag]",
    "test_mamba_model.py::test_matches_one_device[hybrid-tiny-fsdp=8-8-options7]",   # mamba2-tiny-fsdp=8
    "test_experiments_study.py::test_quick_mode[study_measured]",
    "test_multiprocess.py::test_process_count_mismatch",
    "test_checkpoint.py::test_restore_onto_another_mesh_gives_the_same_next_step[fsdp8-8-tp8-8]",
    "test_checkpoint.py::test_restore_onto_another_mesh_gives_the_same_next_step[dp2-fsdp2-tp2-8-fsdp=4-4]",
    "test_data_loader.py::test_stopped_run_on_text_resumes_bitwise",               # ...reads_bitwise_the_same_batches
    "test_moe_zero3.py::test_zero3_over_the_expert_group_matches_one_device",       # ...shards_every_weight_over_it
    "test_strategies.py::test_training_trajectory_matches_one_device[ep4-tp2]",     # its loss and gradients; ep8's
    "test_strategies.py::test_training_trajectory_matches_one_device[cp8-allgather]",  # ...; cp8-ring's trajectory
    "test_experiments_study.py::test_quick_mode[study_tpu_compile]",     # test_tpu_compile's dp2-fsdp2-tp2 case
    # the same rule, beside the stacks' search and memory tests
    "test_strategies.py::test_loss_and_gradients_match_one_device[cp4-tp2-ring]",   # cp8-ring; test_context_parallel
    "test_strategies.py::test_catalogue_strategy_prediction_equals_hlo[fsdp2-ep4]",  # the other EP catalogue cases
    # again after the stacks' context terms: every EP and CP layout's loss and gradients stay in `make test`, and the
    # sharded optimizer update's trajectory on the dense layouts (fsdp8, zero1-dp8, tp8, dp2-fsdp2-tp2)
    "test_strategies.py::test_training_trajectory_matches_one_device[ep8]",
    "test_strategies.py::test_training_trajectory_matches_one_device[cp8-ring]",
    "test_package.py::test_wheel_installs_and_trains_from_any_directory",          # CI's install; test_imports_run_one_way
    "test_strategies.py::test_training_trajectory_matches_one_device[dp8]",        # zero1-dp8, fsdp8, dp2-fsdp2-tp2
    "test_strategies.py::test_training_trajectory_matches_one_device[tp8]",
    "test_strategies.py::test_training_trajectory_matches_one_device[tp4-sp]",
    "test_strategies.py::test_training_trajectory_matches_one_device[dp2-tp4]",
    "test_strategies.py::test_training_trajectory_matches_one_device[fsdp4-tp2-sp]",
    "test_cost_vs_xla.py::test_memory_per_device_matches_xla[mamba2-tiny-dp8]",    # mamba2-tiny-fsdp8
    "test_verify_scale.py::test_data_pipeline_reduces_over_data_once_and_equals_one_device[0]",  # test_pipeline's dp2
    "test_mamba_ops.py::test_block_matches_single_device[context=4]",              # data=2,context=4 and context=4,tensor=2
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.removeprefix("tests/").startswith(SLOW_IDS):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's own order is kept


@pytest.fixture(autouse=True, scope="module")
def drop_the_file_s_caches(request):
    """After each test file, the results it cached (functools caches defined in it) are dropped."""
    yield
    module = request.module
    for value in vars(module).values():
        if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == module.__name__:
            value.cache_clear()


MAPS_CHECKED = [0.0]   # when this worker last counted its memory mappings (counting 40,000 takes ~30 ms)


@pytest.fixture(autouse=True)
def release_compiled_code():
    """Between tests, at most every 10 s: when the worker's memory mappings pass half the kernel's limit, the
    shared compiled steps (tests/harness.py) and JAX's caches are released, so that a long-lived worker's next
    XLA:CPU compile does not segfault (tests/harness.py: why). A file can add 30,000 mappings."""
    yield
    if time.monotonic() - MAPS_CHECKED[0] < 10.0:
        return
    MAPS_CHECKED[0] = time.monotonic()
    if harness.near_map_limit():
        harness.clear_caches()
        harness.release_compiled_code(share=0.0)
