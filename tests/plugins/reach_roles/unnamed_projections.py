"""Projections whose names say no role (issue 46: bound by shape and by a probe of what each does).

Conventions reproduced from classes of public repositories, written here from scratch:

* ``ListedProjections``: q/k/v as an ``nn.ModuleList`` of three ``nn.Linear`` and an ``output_linear`` (BERT-pytorch's
  ``MultiHeadedAttention``): ``forward(query, key, value, mask=None)`` with a keep-mask (``mask == 0`` hidden);
* ``FourNets``: a ``ModuleList`` of three and an ``out_projection_net``, every width ``model_dimension`` (the
  pytorch-original-transformer convention);
* ``ConcatOut``: ``w_q``/``w_k``/``w_v`` and an output layer named ``w_concat`` (hyunwoongko/transformer);
* ``FrozenScale``: the scale as a frozen scalar ``nn.Parameter`` made in the default dtype (PatchTST's
  ``sdp_attn.scale``): in float64 it stays the float32-rounded 1/sqrt(head_dim), 1e-8 off where that is inexact;
* ``ShuffledNets``: three unnamed nets used as value, query, key (in that registration order): only a probe of what
  each does binds them.
"""

import math

import torch
from torch import nn


def _attend(q, k, v, heads, mask=None, scale=None):
    b, t, d = q.shape
    q, k, v = (z.view(b, -1, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(d // heads))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)


class ListedProjections(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        self.h = h
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        query, key, value = (lin(z) for lin, z in zip(self.linear_layers, (query, key, value), strict=True))
        return self.output_linear(_attend(query, key, value, self.h, mask))


class FourNets(nn.Module):
    def __init__(self, model_dimension, number_of_heads, dropout_probability):
        super().__init__()
        self.number_of_heads = number_of_heads
        self.qkv_nets = nn.ModuleList([nn.Linear(model_dimension, model_dimension) for _ in range(3)])
        self.out_projection_net = nn.Linear(model_dimension, model_dimension)

    def forward(self, query, key, value, mask):
        q, k, v = (net(z) for net, z in zip(self.qkv_nets, (query, key, value), strict=True))
        return self.out_projection_net(_attend(q, k, v, self.number_of_heads, mask))


class ShuffledNets(FourNets):
    def forward(self, query, key, value, mask):
        v_net, q_net, k_net = self.qkv_nets
        return self.out_projection_net(_attend(q_net(query), k_net(key), v_net(value), self.number_of_heads, mask))


class ConcatOut(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.w_q, self.w_k, self.w_v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.w_concat = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        return self.w_concat(_attend(self.w_q(q), self.w_k(k), self.w_v(v), self.n_head, mask))


class FrozenScale(nn.Module):
    def __init__(self, d_model, n_heads, qkv_bias=True):
        super().__init__()
        self.n_heads = n_heads
        self.W_Q, self.W_K, self.W_V = (nn.Linear(d_model, d_model, bias=qkv_bias) for _ in range(3))
        head = d_model // n_heads
        self.scale = nn.Parameter(torch.tensor(head ** -0.5), requires_grad=False)
        self.to_out = nn.Linear(d_model, d_model)

    def forward(self, x, attn_mask=None):
        keep = None if attn_mask is None else ~attn_mask
        return self.to_out(_attend(self.W_Q(x), self.W_K(x), self.W_V(x), self.n_heads, keep, self.scale))
