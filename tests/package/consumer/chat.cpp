// The tokenizers' target from an installed meshtorch: a chat template rendered through the minja
// header the install carries.
#include <iostream>

#include <meshtorch/data/chat_template.hpp>

int main() {
  const meshtorch::data::ChatTemplate chat(
      "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}", "consumer",
      {{"eos_token", "</s>"}});
  const auto messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  const auto text = chat.render(messages, nullptr, false, "consumer");
  std::cout << "chat template: " << text << '\n';
  return text == "user: hi</s>" ? 0 : 1;
}
