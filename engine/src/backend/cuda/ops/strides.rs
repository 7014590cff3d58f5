//! Host-side index arithmetic for the strided kernels: broadcasting operands against an output
//! shape into a `Strides` (kernels/prelude.cuh), with dimensions of size 1 dropped and adjacent
//! dimensions merged where every operand allows it, so most launches are rank 1 or 2.

use crate::backend::cuda::abi::{Strides, MAX_DIMS};
use crate::error::{Error, Result};

/// Contiguous row-major strides of `shape`.
pub fn contiguous(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for d in (0..shape.len()).rev() {
        s[d] = acc;
        acc *= shape[d] as i64;
    }
    s
}

/// Strides of an operand of shape `from` broadcast (numpy rules, aligned right) to `to`: its
/// contiguous strides, 0 where it has size 1 or lacks the dimension.
pub fn broadcast(from: &[usize], to: &[usize]) -> Result<Vec<i64>> {
    if from.len() > to.len() {
        return Err(Error::other(format!("cannot broadcast {from:?} to {to:?}")));
    }
    let own = contiguous(from);
    let lead = to.len() - from.len();
    (0..to.len())
        .map(|d| {
            if d < lead {
                return Ok(0);
            }
            let f = from[d - lead];
            if f == to[d] && f != 1 {
                Ok(own[d - lead])
            } else if f == 1 {
                Ok(0)
            } else {
                Err(Error::other(format!("cannot broadcast {from:?} to {to:?}")))
            }
        })
        .collect()
}

/// A `Strides` over the index space `dims` with per-operand `strides` (up to 3) and base
/// offsets, simplified: size-1 dimensions dropped, then neighbours (d, d+1) merged when, for
/// every operand, stride[d] = stride[d+1]·dims[d+1].
pub fn make(dims: &[usize], strides: &[Vec<i64>], base: &[i64]) -> Result<Strides> {
    let k = strides.len();
    let mut ds: Vec<i64> = Vec::new();
    let mut ss: Vec<Vec<i64>> = vec![Vec::new(); k];
    for (d, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let mergeable = !ds.is_empty() && (0..k).all(|o| *ss[o].last().unwrap_or(&0) == strides[o][d] * n as i64);
        if mergeable {
            *ds.last_mut().expect("nonempty") *= n as i64;
            for o in 0..k {
                *ss[o].last_mut().expect("nonempty") = strides[o][d];
            }
        } else {
            ds.push(n as i64);
            for o in 0..k {
                ss[o].push(strides[o][d]);
            }
        }
    }
    if ds.len() > MAX_DIMS {
        return Err(Error::other(format!(
            "index space {dims:?} needs {} dimensions after merging; the CUDA kernels take {MAX_DIMS}",
            ds.len()
        )));
    }
    let mut s = Strides { rank: ds.len() as i32, ..Default::default() };
    for (d, &n) in ds.iter().enumerate() {
        s.dims[d] = n;
        for (o, so) in ss.iter().enumerate() {
            s.stride[o][d] = so[d];
        }
    }
    for (o, &b) in base.iter().enumerate() {
        s.base[o] = b;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_and_merge() {
        assert_eq!(broadcast(&[4], &[2, 3, 4]).unwrap(), vec![0, 0, 1]);
        assert_eq!(broadcast(&[3, 1], &[2, 3, 4]).unwrap(), vec![0, 1, 0]);
        assert!(broadcast(&[3], &[2, 4]).is_err());
        // a contiguous add of two same-shape tensors is one dimension
        let c = contiguous(&[2, 3, 4]);
        let s = make(&[2, 3, 4], &[c.clone(), c], &[]).unwrap();
        assert_eq!((s.rank, s.dims[0], s.stride[0][0], s.stride[1][0]), (1, 24, 1, 1));
        // a bias over rows: [rows, n] with b strides [0, 1] stays 2-D; size-1 dims vanish
        let s = make(&[5, 1, 7], &[contiguous(&[5, 1, 7]), vec![0, 0, 1]], &[]).unwrap();
        assert_eq!((s.rank, &s.dims[..2], &s.stride[1][..2]), (2, &[5i64, 7][..], &[0i64, 1][..]));
        // a transpose does not merge
        let s = make(&[3, 4], &[vec![1, 3], vec![4, 1]], &[]).unwrap();
        assert_eq!(s.rank, 2);
    }
}
