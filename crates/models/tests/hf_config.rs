//! Hugging Face `config.json` in both directions, and the name map against the model's
//! own parameters.

use serde_json::json;
use tpar_models::hf::{hf_name, hf_tensors, tpar_name, HfConfig, HfError};
use tpar_models::{LlamaConfig, LlamaForPretraining};
use tpar_nn::named_parameters;
use tpar_tensor::Device;

/// A transformers 5 `config.json` of a tiny Llama, with `edit` applied to its keys.
fn config(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": true,
        "dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "vocab_size": 96
    });
    edit(v.as_object_mut().unwrap());
    v.to_string()
}

fn parse(text: &str) -> Result<HfConfig, HfError> {
    HfConfig::from_json(text, "dir/config.json")
}

#[test]
fn reads_the_sizes_rope_tie_and_dtype() {
    let c = parse(&config(|_| {})).unwrap();
    let want = LlamaConfig {
        vocab_size: 96,
        max_position_embeddings: 64,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 500000.0,
        ..Default::default()
    };
    assert_eq!(c.llama, want);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
    // Older files: rope_theta and rope_scaling at the top, torch_dtype; absent keys take
    // Hugging Face's defaults (kv heads = heads, untied).
    let old = parse(&config(|m| {
        m.remove("rope_parameters");
        m.remove("num_key_value_heads");
        m.remove("tie_word_embeddings");
        m.remove("dtype");
        m.insert("rope_theta".into(), json!(20000.0));
        m.insert("rope_scaling".into(), json!(null));
        m.insert("torch_dtype".into(), json!("float16"));
    }))
    .unwrap();
    assert_eq!(old.llama.rope_theta, 20000.0);
    assert_eq!(old.llama.num_key_value_heads, 4);
    assert!(!old.tie_word_embeddings);
    assert_eq!(old.torch_dtype.as_deref(), Some("float16"));
    let default_type = parse(&config(|m| {
        m.insert("rope_scaling".into(), json!({"rope_type": "default"}));
    }));
    assert!(default_type.is_ok());
    // Without architectures, model_type decides.
    assert!(parse(&config(|m| {
        m.remove("architectures");
    }))
    .is_ok());
}

#[test]
fn writes_a_config_that_reads_back_equal() {
    let c = parse(&config(|_| {})).unwrap();
    let back = parse(&c.to_json()).unwrap();
    assert_eq!(back, c);
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["architectures"], json!(["LlamaForCausalLM"]));
    assert_eq!(v["eos_token_id"], json!([2, 3]));
    assert_eq!(v["head_dim"], json!(8));
}

#[test]
fn what_tpar_does_not_implement_is_an_error_naming_the_key_and_file() {
    let unsupported =
        |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| match parse(&config(edit))
        {
            Err(HfError::Unsupported { key, file, .. }) => {
                assert_eq!(file, "dir/config.json");
                key
            }
            other => panic!("{other:?}"),
        };
    let key = unsupported(&|m| {
        m.insert("rope_scaling".into(), json!({"type": "dynamic", "factor": 2.0}));
    });
    assert_eq!(key, "rope_scaling");
    // llama3 scaling needs all of its fields.
    let key = unsupported(&|m| {
        m.insert(
            "rope_parameters".into(),
            json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}),
        );
    });
    assert_eq!(key, "rope_parameters.original_max_position_embeddings");
    // linear scaling is read, and written back as read.
    let c = parse(&config(|m: &mut serde_json::Map<String, serde_json::Value>| {
        m.insert("rope_scaling".into(), json!({"type": "linear", "factor": 2.0}));
    }))
    .unwrap();
    assert_eq!(c.llama.rope_scaling, Some(tpar_models::RopeScaling::Linear { factor: 2.0 }));
    assert_eq!(parse(&c.to_json()).unwrap(), c);
    let key = unsupported(&|m| {
        m.insert("hidden_act".into(), json!("gelu"));
    });
    assert_eq!(key, "hidden_act");
    let key = unsupported(&|m| {
        m.insert("attention_bias".into(), json!(true));
    });
    assert_eq!(key, "attention_bias");
    let key = unsupported(&|m| {
        m.insert("head_dim".into(), json!(16));
    });
    assert_eq!(key, "head_dim");

    match parse(&config(|m| {
        m.insert("architectures".into(), json!(["MistralForCausalLM"]));
    })) {
        Err(HfError::Architecture { file, found }) => {
            assert_eq!(file, "dir/config.json");
            assert!(found.contains("MistralForCausalLM"), "{found}");
        }
        other => panic!("{other:?}"),
    }
    match parse(&config(|m| {
        m.remove("architectures");
        m.insert("model_type".into(), json!("gpt2"));
    })) {
        Err(HfError::Architecture { found, .. }) => assert!(found.contains("gpt2"), "{found}"),
        other => panic!("{other:?}"),
    }
    match parse(&config(|m| {
        m.insert("num_attention_heads".into(), json!(3));
        m.remove("head_dim");
    })) {
        Err(e @ HfError::Config { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("dir/config.json") && msg.contains("num_attention_heads"),
                "{msg}"
            );
        }
        other => panic!("{other:?}"),
    }
    match parse(&config(|m| {
        m.insert("hidden_size".into(), json!("32"));
    })) {
        Err(HfError::Json { file, .. }) => assert_eq!(file, "dir/config.json"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn names_map_both_ways_onto_the_models_parameters_with_their_shapes() {
    let cfg = parse(&config(|_| {})).unwrap().llama;
    let model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    let mut from_model: Vec<(String, Vec<usize>)> = named_parameters(&model)
        .into_iter()
        .map(|(n, p)| {
            let hf = hf_name(&n).unwrap();
            assert_eq!(tpar_name(&hf).as_deref(), Some(n.as_str()));
            (hf, p.trainable().dims().to_vec())
        })
        .collect();
    let mut listed = hf_tensors(&cfg);
    from_model.sort();
    listed.sort();
    assert_eq!(from_model, listed);
    assert_eq!(hf_name("rotary_emb.inv_freq"), None);
    assert_eq!(tpar_name("transformer.h.0.attn.c_attn.weight"), None);
}
