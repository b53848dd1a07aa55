"""ONNX draft heads for the tests, written with onnx.helper (no exporter in the loop): Medusa-style
residual heads over `hidden` with a shared output head, heads that read `tokens` only (a lookup
table of the demo model's successors), and the malformed variants of the corpus."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

OPSET = 17


def _model(nodes, inputs, inits, k: int, V: int, opset: int = OPSET, n="n"):
    graph = h.make_graph(nodes, "heads", inputs, [h.make_tensor_value_info("logits", TP.FLOAT, [n, k, V])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def hidden_input(D, n="n"):
    return h.make_tensor_value_info("hidden", TP.FLOAT, [n, D])


def tokens_input(n="n", dtype=TP.INT64):
    return h.make_tensor_value_info("tokens", dtype, [n])


def medusa(D: int, V: int, K: int, seed: int = 0, tokens: bool = False, dtype=np.float32, act: str = "silu",
           n="n", opset: int = OPSET):
    """K heads r_i = x + act(x W_i + b_i), logits_i = r_i U (U shared); with tokens, x = hidden +
    E[tokens]. Weights in dtype (cast to float32 inside); a MatMul by a [K, N] weight, the
    layout the rewrite to x @ W^T must transpose."""
    rng = np.random.default_rng(seed)

    def weight(name, *shape, scale=0.3):
        a = (rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(dtype)
        inits.append(nh.from_array(a, name))
        if dtype == np.float32:
            return name
        nodes.append(h.make_node("Cast", [name], [name + ".f32"], to=TP.FLOAT))
        return name + ".f32"

    inits, nodes, outs = [], [], []
    U = weight("lm_head", D, V, scale=3.0)
    x = "hidden"
    inputs = [hidden_input(D, n)]
    if tokens:
        inputs.append(tokens_input(n))
        E = weight("embed", V, D, scale=20.0)
        nodes += [h.make_node("Gather", [E, "tokens"], ["emb"], axis=0), h.make_node("Add", ["hidden", "emb"], ["x"])]
        x = "x"
    for i in range(K):
        W, b = weight(f"head{i}.w", D, D), weight(f"head{i}.b", D, scale=0.1 * np.sqrt(D))
        nodes += [h.make_node("MatMul", [x, W], [f"z{i}.mm"]), h.make_node("Add", [f"z{i}.mm", b], [f"z{i}"])]
        if act == "silu":
            nodes += [h.make_node("Sigmoid", [f"z{i}"], [f"s{i}"]), h.make_node("Mul", [f"z{i}", f"s{i}"], [f"a{i}"])]
        else:
            nodes.append(h.make_node(act, [f"z{i}"], [f"a{i}"]))
        nodes += [h.make_node("Add", [x, f"a{i}"], [f"r{i}"]), h.make_node("MatMul", [f"r{i}", U], [f"l{i}"]),
                  h.make_node("Unsqueeze", [f"l{i}", "axis1"], [f"u{i}"])]
        outs.append(f"u{i}")
    inits.append(nh.from_array(np.array([1], np.int64), "axis1"))
    nodes.append(h.make_node("Concat", outs, ["logits"], axis=1))
    return _model(nodes, inputs, inits, K, V, opset)


def successor_heads(successor: np.ndarray, K: int, D: int):
    """Heads that read only `tokens`: head i puts logit 1 on the (i + 1)-th successor of the token
    (successor: next token by token, as the demo model's greedy text has it)."""
    V = len(successor)
    table = np.zeros((V, K, V), np.float32)
    cur = np.arange(V)
    for i in range(K):
        cur = successor[cur]
        table[np.arange(V), i, cur] = 1.0
    nodes = [h.make_node("Gather", ["table", "tokens"], ["logits"], axis=0)]
    return _model(nodes, [hidden_input(D), tokens_input()], [nh.from_array(table, "table")], K, V)


def save(model, path):
    onnx.save(model, str(path))
    return path


def malformed(d, D: int, V: int) -> dict:
    """name -> (path, what the one-line error must say)."""
    good = medusa(D, V, 3)
    cases = {}

    def add(name, model_or_bytes, expect):
        path = d / f"{name.replace(' ', '_')}.onnx"
        if isinstance(model_or_bytes, bytes):
            path.write_bytes(model_or_bytes)
        else:
            save(model_or_bytes, path)
        cases[name] = (path, expect)

    raw = good.SerializeToString()
    add("truncated", raw[:len(raw) // 2], "not a readable ONNX model")
    add("not onnx", b"GGUF" + bytes(200), "not a readable ONNX model")
    renamed = medusa(D, V, 3)
    renamed.graph.input[0].name = "hidden_states"
    for node in renamed.graph.node:
        node.input[:] = ["hidden_states" if x == "hidden" else x for x in node.input]
    add("wrong input name", renamed, "input 'hidden_states'")
    add("wrong D", medusa(D + 32, V, 3), f"expected the target's hidden size {D}")
    add("wrong V", medusa(D, V + 16, 3), f"expected the target's vocabulary of {V}")
    add("unsupported op", medusa(D, V, 3, act="Celu"), "operator Celu")
    add("too many heads", medusa(D, V, 8), "expected 1..7")
    add("fixed n", medusa(D, V, 3, n=1), "dim 0 is fixed at 1")
    float_tokens = medusa(D, V, 2, tokens=True)
    float_tokens.graph.input[1].type.tensor_type.elem_type = TP.FLOAT
    add("float tokens", float_tokens, "input 'tokens' is float32")
    short = medusa(D, V, 2, tokens=True)
    embed = next(t for t in short.graph.initializer if t.name == "embed")
    embed.CopyFrom(nh.from_array(nh.to_array(embed)[:V // 2], "embed"))
    add("short token table", short, f"expected a table of at least {V} rows")
    add("float64 weights", medusa(D, V, 2, dtype=np.float64), "is float64; expected float32 or float16")
    add("invalid graph", medusa(D, V, 2, opset=11), "the ONNX checker rejects it")   # Unsqueeze's axes input is opset 13
    return cases
