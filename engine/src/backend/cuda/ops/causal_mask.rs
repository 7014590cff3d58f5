//! Whether an attention mask constant is causal: every [T, T] matrix of it 0 up to and on the
//! diagonal and masked past it (-inf, or at most `MASKED_MIN`: Hugging Face's finfo.min). The
//! tensor-core attention kernels then compute the mask instead of reading it
//! (kernels/attention_mma.cu `causal`): GPT-2 124M's mask is such a constant, folded by the
//! planner into [B, 1, T, T] f32 (64 MB at batch 16), which the kernels otherwise scanned for
//! every 64 x 64 tile and read again for every score.
//!
//! Also whether a mask constant hides nothing (every element 0: [`hides_nothing`]), which key
//! padding leaves of Hugging Face's BERT mask.
//!
//! The answer is remembered per constant, keyed by its allocation: the memo holds a `Weak` to
//! it, which keeps that address from being given to another constant while the entry lives, so
//! the scan (one pass over the mask) runs once per plan rather than once per launch.

use std::sync::{Arc, Mutex, Weak};

use crate::tensor::{Data, Tensor};

/// A mask value at or below this counts as masked (kernels/attention.cuh ATT_MASKED_MIN):
/// added to a real score it leaves exp(score - max) exactly 0 in a row that has a real score,
/// and a causal row always has its diagonal.
pub const MASKED_MIN: f32 = -3.0e38;

/// What a scan found: not causal, or causal with every hidden key masked by the same value
/// (its bits; None where the values differ or nothing is hidden); for [`hides_nothing`]'s scan
/// (side [`ANY_SIDE`]), whether every element is 0.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Found {
    No,
    Causal(Option<u32>),
    Zeros,
}

/// The memo's side for [`hides_nothing`]: that scan looks at every element, whatever the shape.
const ANY_SIDE: usize = 0;

/// (constant, side, answer)
static MEMO: Mutex<Vec<(Weak<Tensor>, usize, Found)>> = Mutex::new(Vec::new());

fn found(mask: &Arc<Tensor>, side: usize) -> Found {
    let mut memo = MEMO.lock().unwrap_or_else(|p| p.into_inner());
    memo.retain(|(w, _, _)| w.strong_count() > 0);
    if let Some((_, _, found)) = memo.iter().find(|(w, s, _)| *s == side && std::ptr::eq(w.as_ptr(), Arc::as_ptr(mask))) {
        return *found;
    }
    let found = scan(mask, side);
    memo.push((Arc::downgrade(mask), side, found));
    found
}

/// Whether `mask` (the constant's host copy) is a causal mask for T = S = `side`.
pub fn is_causal(mask: &Arc<Tensor>, side: usize) -> bool {
    matches!(found(mask, side), Found::Causal(_))
}

/// The one value a causal `mask` hides every key past the diagonal with (None: not causal,
/// different values, or nothing hidden). The flash kernels' key padding needs it to be the
/// padding's own value: then a query with no visible key has every score equal, as in PyTorch.
pub fn hidden_value(mask: &Arc<Tensor>, side: usize) -> Option<f32> {
    match found(mask, side) {
        Found::Causal(Some(bits)) => Some(f32::from_bits(bits)),
        _ => None,
    }
}

/// Whether every element of `mask` (a constant's host copy, of any shape) is 0: added to the
/// scores it hides nothing, and the attention may run as if it had no mask (the flash kernels
/// with key padding: Hugging Face's BERT, whose mask becomes such a constant once its padding
/// is taken apart, passes/attention_key_padding.rs).
pub fn hides_nothing(mask: &Arc<Tensor>) -> bool {
    found(mask, ANY_SIDE) == Found::Zeros
}

fn scan(mask: &Tensor, side: usize) -> Found {
    if side == ANY_SIDE {
        let all_zero = match &mask.data {
            Data::F32(v) => v.iter().all(|&x| x == 0.0),
            Data::BF16(v) => v.iter().all(|x| x.to_f32() == 0.0),
            Data::F16(v) => v.iter().all(|x| x.to_f32() == 0.0),
            _ => false,
        };
        return if all_zero { Found::Zeros } else { Found::No };
    }
    let Data::F32(v) = &mask.data else { return Found::No };
    let n = mask.shape.len();
    if n < 2 || mask.shape[n - 2] != side || mask.shape[n - 1] != side {
        return Found::No;
    }
    let causal = v.chunks_exact(side).enumerate().all(|(i, row)| {
        let r = i % side;
        row[..=r].iter().all(|&x| x == 0.0) && row[r + 1..].iter().all(|&x| x == f32::NEG_INFINITY || x <= MASKED_MIN)
    });
    if !causal {
        return Found::No;
    }
    let hidden = v.chunks_exact(side).enumerate().flat_map(|(i, row)| &row[i % side + 1..]);
    let mut bits = hidden.map(|x| x.to_bits());
    let first = bits.next();
    Found::Causal(first.filter(|&f| bits.all(|b| b == f)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(shape: Vec<usize>, f: impl Fn(usize, usize) -> f32) -> Arc<Tensor> {
        let side = shape[shape.len() - 1];
        let n: usize = shape.iter().product();
        let data = (0..n).map(|i| f((i / side) % shape[shape.len() - 2], i % side)).collect();
        Arc::new(Tensor::new(shape, Data::F32(data)).expect("tensor"))
    }

    #[test]
    fn causal_masks_are_found_and_others_are_not() {
        let causal = |fill: f32| move |r: usize, c: usize| if c > r { fill } else { 0.0 };
        assert!(is_causal(&mask(vec![2, 1, 5, 5], causal(f32::NEG_INFINITY)), 5));
        assert!(is_causal(&mask(vec![5, 5], causal(f32::MIN)), 5));
        // the wrong side, a key hidden on the diagonal, a visible one past it, a small
        // negative value past it, a padding mask, a bf16 or non-square one
        assert!(!is_causal(&mask(vec![5, 5], causal(f32::MIN)), 4));
        assert!(!is_causal(&mask(vec![5, 5], |r, c| if c >= r { f32::NEG_INFINITY } else { 0.0 }), 5));
        assert!(!is_causal(&mask(vec![5, 5], |r, c| if c > r + 1 { f32::NEG_INFINITY } else { 0.0 }), 5));
        assert!(!is_causal(&mask(vec![5, 5], causal(-1e9)), 5));
        assert!(!is_causal(&mask(vec![1, 5], |_, c| if c == 4 { f32::NEG_INFINITY } else { 0.0 }), 5));
        assert!(!is_causal(&mask(vec![4, 5], causal(f32::NEG_INFINITY)), 5));
        let mut one_off = (*mask(vec![3, 5, 5], causal(f32::NEG_INFINITY))).clone();
        if let Data::F32(v) = &mut one_off.data {
            v[2 * 25 + 3 * 5 + 1] = 0.5;
        }
        assert!(!is_causal(&Arc::new(one_off), 5), "the third matrix differs");
    }

    #[test]
    fn the_hidden_value_is_the_one_every_hidden_key_has() {
        let causal = |fill: f32| move |r: usize, c: usize| if c > r { fill } else { 0.0 };
        assert_eq!(hidden_value(&mask(vec![2, 1, 4, 4], causal(f32::MIN)), 4), Some(f32::MIN));
        assert_eq!(hidden_value(&mask(vec![4, 4], causal(f32::NEG_INFINITY)), 4), Some(f32::NEG_INFINITY));
        let mixed = mask(vec![4, 4], |r, c| {
            if c == r + 1 {
                f32::MIN
            } else if c > r {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        });
        assert!(is_causal(&mixed, 4));
        assert_eq!(hidden_value(&mixed, 4), None, "two values");
        assert_eq!(hidden_value(&mask(vec![1, 1], |_, _| 0.0), 1), None, "nothing hidden");
        assert_eq!(hidden_value(&mask(vec![4, 4], |_, _| 0.0), 4), None, "not causal");
    }

    #[test]
    fn a_mask_of_zeros_hides_nothing_whatever_its_shape() {
        assert!(hides_nothing(&mask(vec![1, 1, 6, 1], |_, _| 0.0)), "BERT's mask once its padding is taken apart");
        assert!(hides_nothing(&mask(vec![2, 3, 3], |_, _| -0.0)));
        let zeros = mask(vec![4, 4], |_, _| 0.0);
        assert!(hides_nothing(&zeros));
        assert!(!is_causal(&zeros, 4), "the causal answer for the same constant is its own");
        assert!(!hides_nothing(&mask(vec![4, 4], |r, c| if c > r { f32::MIN } else { 0.0 })));
        assert!(!hides_nothing(&mask(vec![1, 5], |_, c| if c == 4 { -1e-30 } else { 0.0 })), "any value but 0 counts");
        let half = Arc::new(Tensor::new(vec![2, 2], Data::BF16(vec![half::bf16::ZERO; 4])).expect("tensor"));
        assert!(hides_nothing(&half));
        let ints = Arc::new(Tensor::new(vec![2], Data::I64(vec![0, 0])).expect("tensor"));
        assert!(!hides_nothing(&ints), "not a float mask");
    }

    #[test]
    fn the_answer_is_remembered_per_constant_not_per_address_reused() {
        let m = mask(vec![4, 4], |r, c| if c > r { f32::NEG_INFINITY } else { 0.0 });
        assert!(is_causal(&m, 4));
        assert!(is_causal(&m, 4), "from the memo");
        assert!(!is_causal(&m, 2), "asked for another side");
        drop(m);
        // a new constant is scanned for itself (the memo's Weak keeps the old allocation, so
        // the new one cannot have its address)
        let other = mask(vec![4, 4], |_, _| 0.0);
        assert!(!is_causal(&other, 4));
    }
}
