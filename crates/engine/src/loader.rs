//! Opens a model from disk: a GGUF file or a Hugging Face safetensors directory, with
//! its tokenizer and chat template.

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::format::gguf::GgufFile;
use crate::format::safetensors::SafetensorsModel;
use crate::format::{FormatError, TensorSource};
use crate::model::{LayerRange, Model};
use crate::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;

/// Everything a worker or frontend needs from a model directory or file.
pub struct LoadedModel {
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    /// The model's own template, or ChatML when it ships none.
    pub chat: Arc<ChatTemplate>,
    /// File or directory name, used as the served model id.
    pub name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Chat(String),
}

/// What a frontend needs of a model: no weights.
pub struct ModelMeta {
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Arc<ChatTemplate>,
    pub name: String,
    pub context_length: usize,
}

/// Loads `path`: a `.gguf` file, or a directory with config.json and *.safetensors.
pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
    load_layers(path, None)
}

/// [`load`], only `layers` of the model when given (a pipeline stage's).
pub fn load_layers(path: &Path, layers: Option<LayerRange>) -> Result<LoadedModel, LoadError> {
    let name = model_name(path);
    let (model, tokenizer) = if path.is_dir() { load_safetensors(path, layers)? } else { load_gguf(path, layers)? };
    let chat = chat_template(&tokenizer)?;
    Ok(LoadedModel { model: Arc::new(model), tokenizer: Arc::new(tokenizer), chat: Arc::new(chat), name })
}

/// Loads only the tokenizer, chat template and context length of `path` (a frontend
/// process serving workers elsewhere).
pub fn load_meta(path: &Path) -> Result<ModelMeta, LoadError> {
    let (cfg, tokenizer) = if path.is_dir() {
        let st = SafetensorsModel::open(path)?;
        (ModelConfig::from_hf(st.hf_config())?, safetensors_tokenizer(&st, path)?)
    } else {
        let file = GgufFile::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&file.header).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        (ModelConfig::from_gguf(&file.header)?, tokenizer)
    };
    let chat = chat_template(&tokenizer)?;
    Ok(ModelMeta {
        tokenizer: Arc::new(tokenizer),
        chat: Arc::new(chat),
        name: model_name(path),
        context_length: cfg.context_length,
    })
}

fn model_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}

/// The model's own template, or ChatML when it ships none.
fn chat_template(tokenizer: &Tokenizer) -> Result<ChatTemplate, LoadError> {
    match tokenizer.chat_template() {
        Some(src) => {
            let tok_text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
            ChatTemplate::new(src, &tok_text(tokenizer.bos_id()), &tok_text(tokenizer.eos_id()))
                .map_err(|e| LoadError::Chat(e.to_string()))
        }
        None => Ok(ChatTemplate::fallback_chatml()),
    }
}

fn load_gguf(path: &Path, layers: Option<LayerRange>) -> Result<(Model, Tokenizer), LoadError> {
    let file = GgufFile::open(path)?;
    let cfg = ModelConfig::from_gguf(&file.header)?;
    let tokenizer = Tokenizer::from_gguf(&file.header).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    Ok((load_model(&file, cfg, layers)?, tokenizer))
}

fn load_safetensors(dir: &Path, layers: Option<LayerRange>) -> Result<(Model, Tokenizer), LoadError> {
    let st = SafetensorsModel::open(dir)?;
    let tokenizer = safetensors_tokenizer(&st, dir)?;
    let model = load_model(&st, ModelConfig::from_hf(st.hf_config())?, layers)?;
    Ok((model, tokenizer))
}

fn load_model(src: &dyn TensorSource, cfg: ModelConfig, layers: Option<LayerRange>) -> Result<Model, FormatError> {
    match layers {
        Some(l) => Model::load_stage(src, cfg, l),
        None => Model::load(src, cfg),
    }
}

fn safetensors_tokenizer(st: &SafetensorsModel, dir: &Path) -> Result<Tokenizer, LoadError> {
    let json = st
        .tokenizer_json_path()
        .ok_or_else(|| LoadError::Tokenizer(format!("no tokenizer.json in {}", dir.display())))?;
    let mut tokenizer = Tokenizer::from_json_file(&json).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    if let Some(cfg_path) = st.tokenizer_config_path() {
        tokenizer = tokenizer.with_config_file(&cfg_path).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    }
    Ok(tokenizer)
}
