// The chat formats, written out by hand (no Jinja). Sources:
// - Kimi: Kimi K2's chat_template.jinja (moonshotai/Kimi-K2-Instruct; Kimi-Linear uses the same
//   role tokens): each message is <|im_user|> / <|im_assistant|> / <|im_system|> (any other
//   role), then its name or role, <|im_middle|>, the content, <|im_end|>; when the first message
//   is not a system message the template puts "You are Kimi, an AI assistant created by Moonshot
//   AI." first; the generation prompt is <|im_assistant|>assistant<|im_middle|>. No BOS.
// - DeepSeek-V3: the chat_template of deepseek-ai/DeepSeek-V3's tokenizer_config.json:
//   {{bos_token}}{{system prompt (the last system message)}}, then <｜User｜>content for a user,
//   <｜Assistant｜>content<｜end▁of▁sentence｜> for an assistant, and <｜Assistant｜> as the
//   generation prompt.
// - DeepSeek-V3.2: encoding/encoding_dsv32.py of deepseek-ai/DeepSeek-V3.2 (vLLM and SGLang
//   carry copies), chat mode (thinking_mode="chat"): BOS, each system message's content, a user
//   message as <｜User｜>content<｜Assistant｜></think> (the assistant turn opens with the user
//   message, so addGenerationPrompt changes nothing), an assistant message as
//   content<｜end▁of▁sentence｜>.
// Tool calls and tool results are not rendered yet: such messages are refused.
#include "hybrid/runtime/Tokenizer.h"

namespace hybrid {
namespace {

Status unsupportedRole(std::string_view format, const ChatMessage &message, size_t index) {
  return Status::error("\"messages\"[" + std::to_string(index) + "]: role \"" + message.role +
                       "\" is not supported by the " + std::string(format) +
                       " chat format (system, user, assistant)");
}

StatusOr<std::string> renderKimi(std::span<const ChatMessage> messages, bool generation) {
  std::string out;
  if (messages.empty() || messages[0].role != "system")
    out += "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot "
           "AI.<|im_end|>";
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage &message = messages[i];
    if (message.role == "user")
      out += "<|im_user|>";
    else if (message.role == "assistant")
      out += "<|im_assistant|>";
    else if (message.role == "system")
      out += "<|im_system|>";
    else
      return unsupportedRole("kimi", message, i);
    out += message.name.empty() ? message.role : message.name;
    out += "<|im_middle|>";
    out += message.content;
    out += "<|im_end|>";
  }
  if (generation)
    out += "<|im_assistant|>assistant<|im_middle|>";
  return out;
}

constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kUser = "<｜User｜>";
constexpr std::string_view kAssistant = "<｜Assistant｜>";

StatusOr<std::string> renderDeepSeekV3(std::span<const ChatMessage> messages, bool generation) {
  std::string out(kBos);
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != "system" && messages[i].role != "user" &&
        messages[i].role != "assistant")
      return unsupportedRole("deepseek-v3", messages[i], i);
  }
  std::string system;
  for (const ChatMessage &message : messages)
    if (message.role == "system")
      system = message.content; // the template keeps the last one
  out += system;
  for (const ChatMessage &message : messages) {
    if (message.role == "user") {
      out += kUser;
      out += message.content;
    } else if (message.role == "assistant") {
      out += kAssistant;
      out += message.content;
      out += kEos;
    }
  }
  if (generation)
    out += kAssistant;
  return out;
}

StatusOr<std::string> renderDeepSeekV32(std::span<const ChatMessage> messages) {
  std::string out(kBos);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage &message = messages[i];
    if (message.role == "system") {
      out += message.content;
    } else if (message.role == "user") {
      out += kUser;
      out += message.content;
      out += kAssistant;
      out += "</think>";
    } else if (message.role == "assistant") {
      out += message.content;
      out += kEos;
    } else {
      return unsupportedRole("deepseek-v3.2", message, i);
    }
  }
  return out;
}

} // namespace

std::string_view chatFormatName(ChatFormat format) {
  switch (format) {
  case ChatFormat::Kimi:
    return "kimi";
  case ChatFormat::DeepSeekV3:
    return "deepseek-v3";
  case ChatFormat::DeepSeekV32:
    return "deepseek-v3.2";
  case ChatFormat::None:
    break;
  }
  return "none";
}

StatusOr<std::optional<ChatFormat>> parseChatFormat(std::string_view name) {
  if (name == "auto")
    return std::optional<ChatFormat>();
  for (ChatFormat format :
       {ChatFormat::None, ChatFormat::Kimi, ChatFormat::DeepSeekV3, ChatFormat::DeepSeekV32})
    if (chatFormatName(format) == name)
      return std::optional<ChatFormat>(format);
  return Status::error("unknown chat format \"" + std::string(name) +
                       "\" (auto, kimi, deepseek-v3, deepseek-v3.2, none)");
}

StatusOr<std::string> renderChat(ChatFormat format, std::span<const ChatMessage> messages,
                                 bool addGenerationPrompt) {
  if (messages.empty())
    return Status::error("\"messages\" is empty");
  switch (format) {
  case ChatFormat::Kimi:
    return renderKimi(messages, addGenerationPrompt);
  case ChatFormat::DeepSeekV3:
    return renderDeepSeekV3(messages, addGenerationPrompt);
  case ChatFormat::DeepSeekV32:
    return renderDeepSeekV32(messages);
  case ChatFormat::None:
    break;
  }
  return Status::error("the tokenizer has no chat format (hybrid-serve --chat-format)");
}

} // namespace hybrid
