// llama.cpp as a reader of our GGUF files, through node-llama-cpp's prebuilt binaries (tests/test_gguf.py runs it).
//
//   node tests/llamacpp_check.mjs NODE_DIR REQUEST.json
//
// NODE_DIR holds node_modules/node-llama-cpp (README: Development installs it in tests/.node). REQUEST is a list of
// {"model": PATH, "lora": PATH or null, "prompts": [...], "new_tokens": N}, read in one process (starting llama.cpp
// takes seconds). Prints one JSON list, per request {"prompts": [{"tokens": [...], "logprobs": [...], "greedy":
// [...]}]}: each prompt's tokens as llama.cpp's tokenizer reads the GGUF vocabulary (BOS first where the GGUF asks
// for it), the next token's log-probabilities (by token id) and N greedy next tokens.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";

const [nodeDir, requestPath] = process.argv.slice(2);
const requests = JSON.parse(readFileSync(requestPath, "utf8"));
const entry = createRequire(resolve(nodeDir, "package.json")).resolve("node-llama-cpp");
const { getLlama, LlamaLogLevel } = await import(pathToFileURL(entry).href);

// the CPU binary shipped in @node-llama-cpp/linux-x64, as installed: never build llama.cpp, never download
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true,
                               progressLogs: false, logLevel: LlamaLogLevel.error });

async function read(request) {
  const model = await llama.loadModel({ modelPath: request.model });
  const bos = model.shouldPrependBosToken ? model.tokens.bos : null;
  const prompts = [];
  for (const prompt of request.prompts) {
    // a fresh context per prompt: nothing from the previous prompt stays in the KV cache
    const context = await model.createContext({
      contextSize: 256, batchSize: 256, sequences: 1, threads: 1, // tiny models: one thread, no spinning pool
      ...(request.lora ? { lora: { adapters: [{ filePath: request.lora, scale: 1 }] } } : {}),
    });
    const sequence = context.getSequence();
    const tokens = [...(bos === null ? [] : [bos]), ...model.tokenize(prompt)];
    // the next token's distribution over the whole vocabulary, no sampling option narrowing it; yieldEogToken: a
    // sampled end-of-generation token would otherwise end the loop before it yields the distribution (seed: the
    // same draw every time)
    const logprobs = [];
    for await (const step of sequence.evaluateWithMetadata(
      tokens, { probabilities: true }, { temperature: 1, topK: 0, topP: 1, minP: 0, seed: 0, yieldEogToken: true })) {
      for (const [token, p] of step.probabilities) logprobs[token] = Math.log(p);
      break;
    }
    await sequence.clearHistory();
    const greedy = [];
    // temperature 0: argmax of the logits, the same rule as transformers' greedy generate
    for await (const token of sequence.evaluate(tokens, { temperature: 0 })) {
      greedy.push(token);
      if (greedy.length >= request.new_tokens) break;
    }
    prompts.push({ tokens, greedy, logprobs });
    await context.dispose();
  }
  await model.dispose();
  return { prompts };
}

const results = [];
for (const request of requests) results.push(await read(request));
await llama.dispose();
console.log(JSON.stringify(results));
