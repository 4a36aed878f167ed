"""Memory and hand-over: arenas, shared files, pinning, CUDA streams and GPU staging, and the process state they keep.

The core (``building``, ``planning``, ``formats``, ...) plans and builds over plain data and keeps no CUDA or
process state; ``integration`` alone touches vLLM. What lies between, where an adapter's bytes live and how they
move, is here: [`arena`] (the ``Arena`` type, shared-file or anonymous, and the one spare policy both keep),
[`files`] (shared files' folder, names and sweep, a new spare's pages mapped for writing), [`handover`] (a
build's tensors through one shared file), [`cuda`] (the stream pool, the GPU-room check, the GPU transpose,
pinning in place), [`staging`] (staged GPU buffers: layout, pinned copies, a mix's concatenation on the GPU) and
[`pools`] (the kept thread pools). Nothing here imports vLLM.

An adapter's life, from the request that names it to the CPU tensors vLLM keeps (with a background build, the
default; the processes are the API server, the worker that owns a GPU (with one GPU, vLLM's engine-core process),
and that worker's build process; a new mix's path through the modules is in the README, "How it works"):

1. **Probe** (API server). ``integration.server.ensure_built`` sends every worker a probe, a ``LoRARequest``
   whose path is ``PREBUILD_PREFIX + <pinned source>`` (``integration.prebuild.probe_for``), through vLLM's
   ``add_lora``, and polls it until each answers that the build is done (at most ``VLLM_LORA_EXT_PREBUILD_WAIT_S``;
   then the step builds it, as stock vLLM does). The patched ``add_adapter`` answers it in the worker's engine
   thread (``integration.prebuild.answer_probe``) without registering anything.
2. **Table** (worker). ``vllm_lora_ext.prebuild.PrebuildTable.poll`` starts the build, one per pinned source, on
   one of the table's threads: ``integration.prebuild._build`` calls ``integration.loader.load_lora_model``, which
   describes the running model as a picklable ``building.BuildJob`` (``integration.loader.build_job``). For a mix
   (a ``mix:`` path) it builds each component not in ``integration.composite``'s cache this way, several at once,
   and ``integration.composite.compose_mix`` concatenates them (planned by ``mixing.MixPlan``; see step 5).
3. **Build process** (worker thread, then the build process). ``integration.build_process.build_elsewhere``
   sends the job to this worker's build process (``python -m vllm_lora_ext.integration.build_child``), whose
   ``_answer`` runs ``building.build_adapter(job, router, shared=True, arenas=...)``: MoE factors are read and
   packed straight into a shared-file ``arena.Arena`` (``arena.ArenaSupply.take``: the spare file, pages taken
   and, on a tmpfs, mapped for writing (``files.map_for_writing``), if it is large enough). Without a build
   process (switched off, still starting, or its hand-over failed) the worker's thread builds instead
   (``building.build_adapter``), reading into an anonymous ``arena.Arena`` on huge pages, which
   ``integration.loader.assemble`` pins where it lies (``integration._compat.pin_in_place``, then
   ``cuda.register_in_place``) before wrapping it as in step 4; there is no shared file. A process that was still
   starting then plans each such job ahead once started, in the order built (``building.plan_ahead``, up to 8):
   the next adapter of that shape takes the kept header and plan.
4. **/dev/shm shared file** (build process, then worker). ``handover.to_shared`` appends what is not in the
   arena yet (the dense factors) to its file, or, for an adapter without MoE blocks, writes them to a new one
   (``files.shared_dir``: ``VLLM_LORA_EXT_BUILD_DIR``, else ``/dev/shm`` where it has room, else the temp dir);
   the arena's own file went to the same place. The build process answers with the ``handover.SharedTensors``
   manifest over its pipe. In the worker's thread ``handover.from_shared`` maps the file and removes its name:
   the tensors are views of that mapping, never copied. The build process then drops its own views of the build,
   cuts the file's unused tail (``handover.trim_shared``) and prepares its next spare
   (``integration.build_child._after_hand_over``; at its exit it waits for these threads); as
   it starts, it removes the files that owners which died mid-hand-over left (``files.sweep_stale``).
   ``integration.loader.assemble`` wraps the tensors in vLLM's ``LoRAModel`` (``from_lora_tensors`` on
   ``"cpu"``; MoE blocks as packed layers). A mix's component is not wrapped: ``integration.loader.map_component``
   keeps it as core data (``building.MappedAdapter``) in ``integration.composite``'s cache.
5. **GPU staging** (worker, the table's thread). ``integration.staging.stage`` folds each module's scaling into
   B (vLLM's ``optimize()``), lays the CPU factors out in one buffer (``staging._layout``) and, within
   ``VLLM_LORA_EXT_STAGE_GPU_BYTES`` and the GPU's free memory (``cuda.gpu_free_bytes``), copies them to the GPU
   on the staging stream (``cuda.stream_for(device, "staging")``) through two pinned bounce chunks
   (``staging._copy_through_pinned``, its fills on half the cores: ``pools.copy_threads``); the model now points
   at views of that buffer. The factors of the storage holding most of them (the hand-over file, a host arena)
   keep their places there (``staging._as_stored``), so that storage's span goes up whole: for a 2D expert
   adapter about 50 chunk copies instead of one per factor (1,152; 0.039 against 0.113 s on an H200 host alone,
   ``bench/results/probe_stage_copy_h200_r34.json``). A mix is concatenated on the GPU instead (``integration.staging.concat_staged`` with ``staging._upload_and_place``), staged from the
   start. An adapter that does not fit stays in CPU memory, as stock vLLM keeps it. A background build on a GPU
   reads its MoE factors without their NaN/inf scan (``building.BuildJob.scan_moe=False``, the model marked
   ``UNSCANNED_ATTR``); ``integration.staging.refuse_nonfinite`` scans them here, once staged, in a few fused
   launches and one sync (on the CPU if they were not staged), and refuses the model, freeing its buffer, if one
   holds NaN or infinity. Dense factors, a mix's components and every other build are scanned as they are read.
   Such a build also leaves a fused 3D B as stored (``building.BuildJob.defer_turn``, listed in
   ``building.BuiltAdapter.unturned``, the model marked ``UNTURNED_ATTR``): ``stage`` transposes and scales it in
   its staged copy, on the staging stream before the scan, and copies the result back over its CPU tensor on a
   stream of its own (``staging._twins_later``, as for a mix; `unstage` waits for it); where the model is not
   staged it is turned on the CPU there (``formats.moe.turn_in_place``).
   Staging is kept over pinning the
   shared file in place: the driver refused to page-lock a file mapping on the H200 host, and the slot copy from
   it paused in-flight requests 0.26 s against staging's 0.054 s (``bench/results/no_stall_h200x2_r25_pinned_trial.json``).
   Then, on the same thread, vLLM's merge of the model's packed modules (``_create_merged_loras_inplace``, which its
   registration runs in the step) runs on the staging stream (``integration.prebuild.merge_ahead``), over only the
   packed modules the model has parts of (``integration.worker_patches._parts_only``), and the model is marked so
   that the step's registration skips it. After it, vLLM's own ``set_lora``/``reset_lora`` of every LoRA
   module run there under a recorder that writes nothing (``integration.activation.plan_activation``): the model
   keeps the list of its slot writes (destination views of the slot that is free now, and the sources).
6. **Slot copy** (worker, engine thread, in the step). vLLM's ``add_adapter`` (patched by
   ``integration.worker_patches``, a row of ``integration.plugin.PATCHES``) takes the finished model from the
   table (``integration.prebuild.take_built``, from the patched ``_load_adapter``) and activates it: each factor
   is copied into its LoRA slot, GPU to GPU for a staged model, with nothing for vLLM to pin. A model with planned
   writes gets them in a few batched calls (``integration.activation.activate_planned``: zero fills, fills, then
   ``torch._foreach_copy_``) into the slot vLLM picks, with vLLM's bookkeeping; 0.005-0.010 s in the step on an
   H200 with 32 requests decoding, against 0.033-0.041 s for vLLM's per-module calls (``no_stall_h200_r30.json``).
   The plan is used once: a later activation (after an eviction) is vLLM's own, from the CPU twins.
7. **Unstage** (worker, engine thread, right after). The patched ``add_adapter`` calls
   ``integration.staging.unstage``: the model drops its planned writes and points back at CPU tensors equal to its
   GPU ones, and the GPU buffer is freed once the engine's stream has run past the slot copy (``record_stream``).
8. **CPU twins** (worker). What the registered model keeps, for vLLM to copy into a slot again after an
   eviction: views of the shared mapping (step 4; it lives as long as they do), or of the pinned anonymous
   arena (worker builds; unpinned and unmapped when the last view goes). A mix built on the CPU
   (``integration.composite.host_concat``; large enough, host arenas on) is concatenated into a kept host arena
   (``cuda.kept_host_arena``), pinned in place, whose memory may become the spare when its last view goes (up to
   ``VLLM_LORA_EXT_HOST_SPARE_BYTES``; ``arena.prepare_spare`` makes the next one ahead). A mix built on the
   GPU has no CPU tensors yet: a helper thread copies them back from the GPU into a kept, pinned host arena
   (``integration.staging.attach_staged`` running ``twins_from_gpu``, ``cuda.kept_host_arena``) and points a
   model whose slot copy is done at them.
"""
