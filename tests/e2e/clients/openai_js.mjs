// The OpenAI JS SDK, unmodified, against an OpenAI-compatible server:
//   node openai_js.mjs BASE_URL MODEL
// Streams a chat completion (with the usage chunk) and asks for a completion without
// streaming; prints what the SDK parsed as one JSON line for tests/e2e/test_clients.py.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "none", maxRetries: 0 });

const stream = await client.chat.completions.create({
  model,
  messages: [{ role: "user", content: "Tell me about the small green dog." }],
  max_tokens: 8,
  stream: true,
  stream_options: { include_usage: true },
});
const chat = { content: "", chunks: 0, ids: new Set(), objects: new Set(), finish_reason: null,
               usage: null };
for await (const chunk of stream) {
  chat.chunks += 1;
  chat.ids.add(chunk.id);
  chat.objects.add(chunk.object);
  for (const choice of chunk.choices) {
    chat.content += choice.delta?.content ?? "";
    chat.finish_reason = choice.finish_reason ?? chat.finish_reason;
  }
  if (chunk.usage) chat.usage = chunk.usage;
}

const completion = await client.completions.create({ model, prompt: "the dog", max_tokens: 4 });

console.log(JSON.stringify({
  chat: { ...chat, ids: [...chat.ids], objects: [...chat.objects] },
  completion: { object: completion.object, text: completion.choices[0].text,
                finish_reason: completion.choices[0].finish_reason, usage: completion.usage },
}));
