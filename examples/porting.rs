//! The tpar column of `docs/PORTING.md`: a PyTorch FSDP x TP Llama training script,
//! line for line (each block's comment is the PyTorch line it replaces).
//!
//! Run: `cargo run --release --example porting` (4 ranks as threads, dp 2 x tp 2, a
//! small Llama, 8 steps on the shipped corpus). Its last line is a `summary:`.

use tpar::checkpoint as dcp;
use tpar::prelude::*;

const STEPS: usize = 8;

fn train(ctx: RankCtx) -> tpar::Result<(f64, f64)> {
    // mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;

    // with torch.device("meta"): model = Llama(config)
    let config = LlamaConfig {
        vocab_size: ByteTokenizer::VOCAB_SIZE,
        max_position_embeddings: 64,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        ..Default::default()
    };
    let mut model = LlamaForPretraining::new(&config, Device::Meta)?;

    // layer_plan = {"input_layernorm": SequenceParallel(), "self_attn": PrepareModuleInput(
    //     input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None,
    //     None)), "self_attn.q_proj": ColwiseParallel(), ...}
    let layer_plan = ParallelizePlan::new()
        .add("input_layernorm", SequenceParallel::new())
        .add(
            "self_attn",
            PrepareModuleInput::new(
                vec![Some(Placement::Shard(1)), None, None],
                vec![Some(Placement::Replicate), None, None],
            ),
        )
        .add("self_attn.q_proj", ColwiseParallel::new())
        .add("self_attn.k_proj", ColwiseParallel::new())
        .add("self_attn.v_proj", ColwiseParallel::new())
        .add("self_attn.o_proj", RowwiseParallel::new().output_layouts(Placement::Shard(1)))
        .add("post_attention_layernorm", SequenceParallel::new())
        .add(
            "mlp",
            PrepareModuleInput::new(
                vec![Some(Placement::Shard(1))],
                vec![Some(Placement::Replicate)],
            ),
        )
        .add("mlp.gate_proj", ColwiseParallel::new())
        .add("mlp.up_proj", ColwiseParallel::new())
        .add("mlp.down_proj", RowwiseParallel::new().output_layouts(Placement::Shard(1)));
    // for block in model.layers: parallelize_module(block, mesh["tp"], layer_plan)
    for layer in &mut model.base_model.layers.items {
        parallelize_module(layer, &mesh["tp"], &layer_plan)?;
    }
    // parallelize_module(model, mesh["tp"], {"embed_tokens": RowwiseParallel(...), ...})
    let top_plan = ParallelizePlan::new()
        .add(
            "base_model.embed_tokens",
            RowwiseParallel::new()
                .input_layouts(Placement::Replicate)
                .output_layouts(Placement::Shard(1)),
        )
        .add("base_model.norm", SequenceParallel::new())
        .add(
            "lm_head",
            ColwiseParallel::new().input_layouts(Placement::Shard(1)).use_local_output(false),
        );
    parallelize_module(&mut model, &mesh["tp"], &top_plan)?;

    // for i, block in enumerate(model.layers): model.layers[i] = ptd_checkpoint_wrapper(
    //     block, context_fn=selective_checkpointing_context_fn)  (torchtitan's apply_ac,
    //     mode "selective": attention's and every second matmul's outputs kept)
    apply_activation_checkpointing(&mut model, &AcPolicy::selective())?;

    // for block in model.layers: fully_shard(block, mesh=mesh["dp"]); fully_shard(model, ...)
    for layer in &mut model.base_model.layers.items {
        fully_shard(layer, &mesh["dp"], &FsdpConfig::default())?;
    }
    fully_shard(&mut model, &mesh["dp"], &FsdpConfig::default())?;

    // model.to_empty(device="cpu"); model.init_weights(seed)
    reset_parameters(&mut model, Device::Cpu, 0)?;

    // dataset = ...; sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank)
    let docs = default_documents();
    let dataset = PretrainingDataset::new(&docs, &ByteTokenizer, 32)?;
    let mut sampler = DistributedSampler::new(2, mesh["dp"].local_rank())?.with_seed(0);

    // optimizer = AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    let config_adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 };
    let mut optimizer = AdamW::with_names(named_parameters(&model), config_adamw)?;
    // scheduler = SequentialLR(optimizer, [LinearLR(...), CosineAnnealingLR(...)], [warmup])
    let warmup_cosine = SequentialLR::warmup_cosine(2, STEPS, 0.1, 1e-4)?;
    let mut scheduler = LrScheduler::new(warmup_cosine, &mut optimizer);
    let params = parameters(&model);

    // with loss_parallel():
    let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    sampler.set_epoch(0);
    let indices = sampler.indices(dataset.len());
    for (step, rows) in indices.chunks(4).take(STEPS).enumerate() {
        let batch = dataset.batch(rows)?;
        // logits = model(input_ids, attention_mask)
        let logits = model.logits(&batch.input_ids, Some(&batch.attention_mask))?;
        // loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), ignore_index=pad)
        let targets = batch.target_ids.reshape([batch.target_ids.numel()])?;
        let loss = logits
            .reshape(&[-1, config.vocab_size as isize])?
            .cross_entropy(&targets, dataset.pad_id() as i64)?;
        // loss.backward()
        loss.backward()?;
        // clip_grad_norm_(model.parameters(), 1.0)
        clip_grad_norm_(&params, 1.0, &ClipOptions::default())?;
        // optimizer.step(); scheduler.step(); optimizer.zero_grad()
        optimizer.step()?;
        scheduler.step(&mut optimizer);
        optimizer.zero_grad();
        let l = loss.item()?;
        if step == 0 {
            first = l;
        }
        last = l;
        if ctx.rank() == 0 {
            println!("step {step} loss {l:.4} lr {:.2e}", scheduler.last_lr());
        }
    }

    // dcp.save({"model": model, "optim": optimizer, ...}, checkpoint_id=f"{dir}/step-{n}")
    // (torchtitan's CheckpointManager: every N steps, keep the last K, resume the latest)
    let world = ctx.world_group();
    let dir = std::env::temp_dir().join(format!("tpar-porting-{}", std::process::id()));
    let config = CheckpointConfig { keep: Some(1), ..Default::default() };
    let mut checkpoints = CheckpointManager::new(&dir, &world, config)?;
    let mut model_state = ModuleState::new(&mut model);
    let mut items: [(&str, &mut dyn Stateful); 4] = [
        ("model", &mut model_state),
        ("optim", &mut optimizer),
        ("lr_scheduler", &mut scheduler),
        ("sampler", &mut sampler),
    ];
    checkpoints.save(STEPS as u64, &mut items)?;
    // dcp.load(state_dict, checkpoint_id=...); model.load_state_dict(...); ... (resume)
    let resumed = checkpoints.load_latest(&mut items)?;
    assert_eq!(resumed, Some(STEPS as u64));

    // get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
    //     cpu_offload=True)); save_file(model_sd, "model.safetensors") on rank 0
    let opts = StateDictOptions { full_state_dict: true, cpu_offload: true, ..Default::default() };
    let (full, _) = dcp::get_state_dict(&model, None, &world, &opts)?;
    if ctx.rank() == 0 {
        assert_eq!(full.len(), named_parameters(&model).len());
    }
    dcp::export_safetensors(
        &tpar::nn::state_dict(&model)?,
        &dir.join("model.safetensors"),
        &world,
    )?;
    world.barrier()?;
    if ctx.rank() == 0 {
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok((first, last))
}

fn main() -> tpar::Result<()> {
    // torchrun --nproc-per-node 4 train.py (here: 4 ranks as threads of this process)
    let out = spawn(4, train)?;
    let (first, last) = out[0];
    println!("summary: world=4 dp=2 tp=2 steps={STEPS} first_loss={first:.4} final_loss={last:.4}");
    if !(last.is_finite() && last < first) {
        eprintln!("porting: loss did not fall ({first} -> {last})");
        std::process::exit(1);
    }
    Ok(())
}
