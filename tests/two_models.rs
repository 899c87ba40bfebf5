//! Gradient state is the tensors' own: two models trained at once in one process (each
//! over its own world of rank threads, tensor-parallel with sequence parallelism, so
//! their replicated parameters' gradients are reduced once by the clip and reused by the
//! optimizer) train exactly as each does alone.

use tpar::prelude::*;

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        max_position_embeddings: 8,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        ..Default::default()
    }
}

/// Per-step losses (as bits) of 4 steps of a tp-2 sequence-parallel Llama from `seed`.
fn train(seed: u64) -> Vec<u64> {
    let out = spawn(2, move |ctx| -> tpar::Result<Vec<u64>> {
        let world = ctx.world_group();
        let mesh = DeviceMesh::new(&world, DeviceType::Cpu, &[2], &["tp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())?;
        reset_parameters(&mut model, Device::Cpu, seed)?;
        let params = parameters(&model);
        let mut opt = AdamW::with_names(named_parameters(&model), AdamWConfig::default())?;
        let _lp = loss_parallel::enable(&mesh["tp"]);
        let mut losses = Vec::new();
        for step in 0..4u64 {
            let ids: Vec<i64> = (0..16).map(|i| ((i * 5 + step * 7 + seed) % 32) as i64).collect();
            let ids = Tensor::from_vec(ids, [2, 8])?;
            let logits = model.logits(&ids, None)?.reshape(&[-1, 32])?;
            let loss = logits.cross_entropy(&ids.reshape([16])?, -100)?;
            loss.backward()?;
            clip_grad_norm_(&params, 0.5, &ClipOptions::default())?;
            opt.step()?;
            opt.zero_grad();
            losses.push(loss.into_local("loss")?.item()?.to_bits());
        }
        Ok(losses)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn two_models_in_one_process_train_as_each_does_alone() {
    let alone = [train(1), train(2)];
    assert_ne!(alone[0], alone[1]);
    for _ in 0..3 {
        let other = std::thread::spawn(|| train(2));
        let first = train(1);
        assert_eq!(first, alone[0], "model 1 next to model 2");
        assert_eq!(other.join().unwrap(), alone[1], "model 2 next to model 1");
    }
}
