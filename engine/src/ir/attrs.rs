//! Node attributes and typed accessors that name the node and attribute in their errors.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Float(f32),
    Int(i64),
    String(String),
    Tensor(Tensor),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attrs(pub Vec<(String, Attr)>);

impl Attrs {
    pub fn get(&self, name: &str) -> Option<&Attr> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }
    pub fn set(&mut self, name: &str, value: Attr) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value,
            None => self.0.push((name.to_string(), value)),
        }
    }
    pub fn with(mut self, name: &str, value: Attr) -> Self {
        self.set(name, value);
        self
    }
    fn wrong(name: &str, want: &str) -> Error {
        Error::other(format!("attribute '{name}' must be {want}"))
    }
    pub fn int(&self, name: &str, default: i64) -> Result<i64> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Int(v)) => Ok(*v),
            Some(_) => Err(Self::wrong(name, "an int")),
        }
    }
    pub fn req_int(&self, name: &str) -> Result<i64> {
        match self.get(name) {
            Some(Attr::Int(v)) => Ok(*v),
            None => Err(Error::other(format!("attribute '{name}' is required"))),
            Some(_) => Err(Self::wrong(name, "an int")),
        }
    }
    pub fn float(&self, name: &str, default: f32) -> Result<f32> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Float(v)) => Ok(*v),
            Some(Attr::Int(v)) => Ok(*v as f32),
            Some(_) => Err(Self::wrong(name, "a float")),
        }
    }
    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>> {
        match self.get(name) {
            None => Ok(None),
            Some(Attr::Ints(v)) => Ok(Some(v.clone())),
            Some(Attr::Int(v)) => Ok(Some(vec![*v])),
            Some(_) => Err(Self::wrong(name, "a list of ints")),
        }
    }
    pub fn string(&self, name: &str, default: &str) -> Result<String> {
        match self.get(name) {
            None => Ok(default.to_string()),
            Some(Attr::String(s)) => Ok(s.clone()),
            Some(_) => Err(Self::wrong(name, "a string")),
        }
    }
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        match self.get(name) {
            Some(Attr::Tensor(t)) => Some(t),
            _ => None,
        }
    }
}
