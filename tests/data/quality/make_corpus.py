# ruff: noqa: E501  (the corpus is data: long literal lines read better unwrapped)
"""Writes clean.jsonl and garbled.jsonl: the labelled corpus for the garbage-text detector.

Every sample is written out here so the corpus can be reviewed and regenerated
(`python tests/data/quality/make_corpus.py`). Clean samples are answers a healthy model gives,
chosen to be hard for a detector (refrains, repeated table cells, closing braces, lists with a
fixed shape, mixed scripts where the prompt asks for them). Garbled samples imitate what broken
speculative decoding really produces: a good start then a loop, a script switch mid-sentence,
template and role leaks, numbering loops, replies that stop after a few tokens.
Derived garbled samples are built from clean ones with a fixed seed, so the file is stable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
STORY_PROMPT = "Say hello in one short sentence."


def c(text, prompt="", note="", finish_reason="stop", **extra):
    return {"text": text, "prompt": prompt, "finish_reason": finish_reason, "label": "clean", "note": note, **extra}


def g(text, prompt="", note="", finish_reason="stop", **extra):
    return {"text": text, "prompt": prompt, "finish_reason": finish_reason, "label": "garbage", "note": note, **extra}


# ---------------------------------------------------------------------------------------------
# Clean

CLEAN = [
    # Short, complete answers.
    c("Hello!", STORY_PROMPT, "short greeting", completion_tokens=2),
    c("Hello there, it's nice to meet you!", STORY_PROMPT, "short greeting with comma inside"),
    c("Hi there! How can I help?", "hi", "short chat reply"),
    c("Yes.", "Is water wet?", "one word"),
    c("No", "Is 7 an even number? Answer yes or no.", "one word, no punctuation"),
    c("42", "What is 6 times 7? Reply with the number only.", "bare number"),
    c("Paris", "Capital of France? One word.", "bare name"),
    c("The capital of Australia is Canberra.", "What is the capital of Australia?", "one sentence"),
    c("Sure — 17 × 23 = 391.", "Compute 17*23.", "arithmetic with symbols"),
    c("👍", "React with an emoji.", "emoji only"),
    c("Good morning! ☀️ Hope your day goes well.", "Greet me in the morning.", "emoji inside"),
    c("True", "Is 2 a prime? Answer True or False.", "boolean"),
    c("H₂O", "Chemical formula of water?", "subscript"),
    c("It is what it is.", "Give me a common English saying.", "ends on a verb"),
    c("Where are you from?", "Translate '¿De dónde eres?' to English.", "question ending on a preposition",),
    c("Thank you!", "How do you say 'gracias' in English?", "short"),
    c("Blue.", "What colour is a clear daytime sky?", "short"),
    c("1969", "In what year did Apollo 11 land on the Moon? Year only.", "year"),
    c("O(n log n)", "Time complexity of merge sort?", "big-O"),
    c("Sure! Here's one: Why don't scientists trust atoms? Because they make up everything.",
      "Tell me a joke.", "joke"),
    # Paragraphs.
    c("Photosynthesis is the process by which green plants, algae and some bacteria turn light energy "
      "into chemical energy. Using sunlight, they combine carbon dioxide from the air with water to make "
      "glucose, releasing oxygen as a by-product. The reaction takes place mainly in the chloroplasts, "
      "where the pigment chlorophyll absorbs red and blue light.",
      "Explain photosynthesis briefly.", "explanation"),
    c("Speculative decoding speeds up generation by letting a small draft model propose several tokens, "
      "which the large target model then verifies in a single forward pass. Tokens that match the target's "
      "own choice are kept; at the first mismatch the target's token is used instead. Because every "
      "committed token is one the target would have produced, the output is unchanged at temperature zero.",
      "What is speculative decoding?", "technical explanation"),
    c("The French Revolution (1789–1799) overthrew the monarchy, established a republic and ended with "
      "Napoleon's rise to power. Its ideas — liberty, equality and fraternity — shaped modern democracies, "
      "although the period also saw the Reign of Terror, in which thousands were executed.",
      "Summarize the French Revolution in three sentences.", "history with dashes"),
    c("A café in Paris serves crêpes, croissants and café au lait; the naïve tourist may order a "
      "'French coffee' and get a blank stare. Façade, résumé and déjà vu are other French words English "
      "kept with their accents.",
      "Give examples of French loanwords in English.", "Latin diacritics"),
    c("Black holes form when massive stars collapse at the end of their lives. Their gravity is so strong "
      "that nothing, not even light, can escape once it crosses the event horizon. Astronomers detect them "
      "indirectly, through the X-rays emitted by gas falling in, the orbits of nearby stars, or the "
      "gravitational waves produced when two black holes merge.",
      "How do black holes form and how do we detect them?", "science"),
    c("To reset your password, open Settings, choose Account, then Security, and click \"Forgot password\". "
      "You will receive an e-mail with a link that is valid for 24 hours. If it does not arrive, check your "
      "spam folder or contact support@example.com.",
      "How do I reset my password?", "instructions with email"),
    c("The mitochondria is often called the powerhouse of the cell because it produces most of the cell's "
      "ATP through oxidative phosphorylation. It has its own DNA, inherited from the mother, which supports "
      "the theory that it descends from free-living bacteria.",
      "What do mitochondria do?", "biology"),
    c("I'm sorry, but I can't help with that request. If you're having thoughts of harming yourself, please "
      "reach out to someone you trust or a local crisis line — you don't have to go through this alone.",
      "…", "refusal"),
    c("Rust's ownership model guarantees memory safety without a garbage collector. Each value has a single "
      "owner; when the owner goes out of scope the value is dropped. References borrow a value without "
      "taking ownership, and the borrow checker ensures that you either have one mutable reference or any "
      "number of immutable ones, never both at the same time.",
      "Explain Rust ownership.", "programming explanation"),
    c("See the official documentation at https://docs.python.org/3/library/asyncio.html and the tutorial at "
      "https://realpython.com/async-io-python/ for more examples.",
      "Where can I learn asyncio?", "URLs"),
    c("Both options work. If you value battery life, pick the MacBook Air; if you need more ports and a "
      "brighter screen, the MacBook Pro is worth the extra money. For most students the Air is enough.",
      "MacBook Air or Pro for a student?", "advice"),
    c("Dear Ms. Patel,\n\nThank you for your interview on Tuesday. I enjoyed learning about the data team's "
      "plans and I am excited about the opportunity to contribute.\n\nBest regards,\nJordan",
      "Write a short thank-you email after an interview.", "email with sign-off"),
    c("In summary: use a virtual environment, pin your dependencies, and run the tests before every release. "
      "That's it.", "Give me three Python packaging tips.", "summary"),
    # Lists.
    c("Here are the steps:\n\n1. Preheat the oven to 180 °C.\n2. Mix the flour, sugar and baking powder.\n"
      "3. Beat in the eggs and milk.\n4. Pour the batter into a greased tin.\n5. Bake for 25 minutes.\n"
      "6. Let it cool before slicing.", "How do I bake a simple cake?", "numbered list"),
    c("- Step 1: Install Python.\n- Step 2: Create a virtual environment.\n- Step 3: Install the "
      "requirements.\n- Step 4: Run the tests.\n- Step 5: Start the server.\n- Step 6: Open the browser.",
      "List setup steps.", "repeated list shape"),
    c("1. Apple\n1. Banana\n1. Cherry\n1. Date", "Write a markdown list of four fruits using lazy numbering.",
      "markdown lazy numbering"),
    c("Pros:\n- Fast\n- Cheap\n- Easy to use\n\nCons:\n- Limited support\n- No offline mode",
      "Pros and cons of the tool?", "bullets"),
    c("* Monday: gym\n* Tuesday: rest\n* Wednesday: gym\n* Thursday: rest\n* Friday: gym\n* Saturday: rest\n"
      "* Sunday: long walk", "Give me a weekly exercise plan.", "alternating list items"),
    c("Top 10 most populous countries (2023):\n1. India\n2. China\n3. United States\n4. Indonesia\n5. Pakistan\n"
      "6. Nigeria\n7. Brazil\n8. Bangladesh\n9. Russia\n10. Mexico",
      "List the 10 most populous countries.", "ten-item list"),
    c("Checklist:\n- [x] Write tests\n- [x] Update docs\n- [ ] Tag the release\n- [ ] Announce it",
      "Release checklist?", "task list"),
    c("Answers: 1. B  2. D  3. A  4. C  5. B", "Give the answer key for the quiz.", "answer key"),
    c("Q1: What is 2 + 2? A: 4\nQ2: What is 3 + 5? A: 8\nQ3: What is 9 − 4? A: 5",
      "Make three arithmetic flashcards.", "repeated Q/A shape"),
    c("**Ingredients**\n- 2 eggs\n- 1 cup of milk\n- 1 cup of flour\n- 1 pinch of salt\n- 1 tbsp of butter",
      "Pancake ingredients?", "repeated '1 cup of'"),
    # Code.
    c("```python\ndef fizzbuzz(n: int) -> list[str]:\n    out = []\n    for i in range(1, n + 1):\n"
      "        if i % 15 == 0:\n            out.append(\"FizzBuzz\")\n        elif i % 3 == 0:\n"
      "            out.append(\"Fizz\")\n        elif i % 5 == 0:\n            out.append(\"Buzz\")\n"
      "        else:\n            out.append(str(i))\n    return out\n```", "Write FizzBuzz in Python.", "python code"),
    c("```c\n#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 3; i++) {\n        for (int j = 0; j < 3; j++) {\n"
      "            if (i == j) {\n                printf(\"%d\\n\", i);\n            }\n        }\n    }\n    return 0;\n}\n```",
      "Write nested loops in C.", "closing braces"),
    c("```javascript\nconst users = [\n  { name: \"Ana\", age: 31 },\n  { name: \"Bo\", age: 25 },\n"
      "  { name: \"Cy\", age: 40 },\n];\nconst adults = users.filter((u) => u.age >= 18);\nconsole.log(adults);\n```",
      "Filter adults in JS.", "js"),
    c("```json\n[\n  {\"id\": 1, \"done\": false, \"tags\": []},\n  {\"id\": 2, \"done\": false, \"tags\": []},\n"
      "  {\"id\": 3, \"done\": false, \"tags\": []},\n  {\"id\": 4, \"done\": false, \"tags\": []},\n"
      "  {\"id\": 5, \"done\": false, \"tags\": []}\n]\n```", "Give me 5 empty todo items as JSON.", "json repeated keys"),
    c("{\"name\": \"widget\", \"price\": 9.99, \"in_stock\": true, \"sizes\": [\"S\", \"M\", \"L\"]}",
      "Return the product as JSON, no prose.", "bare json"),
    c("```sql\nSELECT c.name, COUNT(o.id) AS orders\nFROM customers c\nLEFT JOIN orders o ON o.customer_id = c.id\n"
      "GROUP BY c.name\nORDER BY orders DESC\nLIMIT 10;\n```", "Top 10 customers by orders in SQL.", "sql"),
    c("```bash\nset -euo pipefail\nfor f in *.log; do\n  gzip -9 \"$f\"\ndone\necho done\n```",
      "Compress all log files.", "bash"),
    c("```rust\nfn main() {\n    let v = vec![1, 2, 3];\n    let total: i32 = v.iter().sum();\n    println!(\"{total}\");\n}\n```",
      "Sum a vector in Rust.", "rust"),
    c("```go\npackage main\n\nimport \"fmt\"\n\nfunc main() {\n\tch := make(chan int)\n\tgo func() { ch <- 42 }()\n"
      "\tfmt.Println(<-ch)\n}\n```", "Go channel example.", "go"),
    c("```yaml\nservices:\n  web:\n    image: nginx:1.27\n    ports:\n      - \"80:80\"\n  db:\n    image: postgres:16\n"
      "    environment:\n      POSTGRES_PASSWORD: example\n```", "docker compose for nginx + postgres", "yaml"),
    c("```html\n<ul>\n  <li>One</li>\n  <li>Two</li>\n  <li>Three</li>\n  <li>Four</li>\n</ul>\n```",
      "HTML list of four items.", "html repeated tags"),
    c("```python\nimport numpy as np\n\nI = np.array([\n    [1, 0, 0, 0],\n    [0, 1, 0, 0],\n    [0, 0, 1, 0],\n"
      "    [0, 0, 0, 1],\n])\nZ = np.zeros((4, 4))\nprint(I + Z)\n```", "4x4 identity in numpy", "matrix of zeros"),
    c("Use `print(\"hello\")` three times:\n\n```python\nprint(\"hello\")\nprint(\"hello\")\nprint(\"hello\")\n```",
      "Show code that prints hello three times.", "repeated code lines"),
    c("```python\nclass Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
      "        self._items.append(item)\n\n    def pop(self):\n        return self._items.pop()\n\n    def peek(self):\n"
      "        return self._items[-1]\n\n    def __len__(self):\n        return len(self._items)\n```",
      "Implement a stack class.", "python class"),
    c("The ChatML format wraps each turn like this:\n\n```\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
      "Hello!<|im_end|>\n```\n\nThe `<|im_end|>` token ends a turn.", "Explain the ChatML chat template.",
      "template tokens in code, asked for"),
    c("```css\n.btn {\n  padding: 8px 16px;\n  border: none;\n  border-radius: 4px;\n}\n.btn:hover {\n  opacity: 0.9;\n}\n```",
      "CSS for a button.", "css"),
    c("Run `pip install -r requirements.txt`, then `pytest -q`. If a test fails, rerun with `pytest -x --pdb`.",
      "How do I run the tests?", "inline code"),
    # Maths.
    c("By the quadratic formula, $x = \\frac{-b \\pm \\sqrt{b^2 - 4ac}}{2a}$. For $x^2 - 5x + 6 = 0$ we get "
      "$x = \\frac{5 \\pm 1}{2}$, so $x = 3$ or $x = 2$.", "Solve x^2-5x+6=0.", "LaTeX"),
    c("The area of a circle is A = πr². With r = 3 cm, A = 9π ≈ 28.27 cm².", "Area of a circle of radius 3 cm?",
      "pi symbol"),
    c("Let α and β be the roots. Then α + β = −b/a and αβ = c/a (Vieta's formulas).", "Vieta's formulas?",
      "Greek letters"),
    c("$$\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}$$\n\nProof by induction: for n = 1 both sides equal 1. "
      "Assume it holds for n; then $\\sum_{k=1}^{n+1} k = \\frac{n(n+1)}{2} + (n+1) = \\frac{(n+1)(n+2)}{2}$.",
      "Prove the sum formula.", "display maths"),
    c("1 + 1 = 2\n2 + 2 = 4\n4 + 4 = 8\n8 + 8 = 16\n16 + 16 = 32", "Keep doubling from 1, five lines.",
      "repeated arithmetic shape"),
    c("∀ε > 0 ∃δ > 0 : |x − a| < δ ⇒ |f(x) − f(a)| < ε", "Write the epsilon-delta definition symbolically.",
      "logic symbols"),
    c("The derivative of sin(x) is cos(x), and the derivative of cos(x) is −sin(x). So d²/dx² sin(x) = −sin(x).",
      "Second derivative of sin x?", "calculus"),
    c("Matrix product:\n\n| 1 0 |   | a b |   | a b |\n| 0 1 | × | c d | = | c d |", "Identity times a matrix.",
      "ascii matrix"),
    c("0.1 + 0.2 = 0.30000000000000004 in IEEE 754 double precision, because neither 0.1 nor 0.2 is exactly "
      "representable in binary.", "Why is 0.1+0.2 not 0.3?", "floating point"),
    c("Mean = (2 + 4 + 4 + 4 + 5 + 5 + 7 + 9) / 8 = 5. Variance = 4, so σ = 2.", "Std dev of 2,4,4,4,5,5,7,9?",
      "repeated numbers"),
    # Tables.
    c("| Feature | Free | Pro | Team |\n|---|---|---|---|\n| Projects | 3 | Unlimited | Unlimited |\n"
      "| Storage | 1 GB | 100 GB | 1 TB |\n| Support | ✗ | ✓ | ✓ |\n| SSO | ✗ | ✗ | ✓ |\n| API | ✗ | ✓ | ✓ |",
      "Compare the plans in a table.", "table with repeated cells"),
    c("| Day | Open | Close |\n|-----|------|-------|\n| Mon | 9:00 | 17:00 |\n| Tue | 9:00 | 17:00 |\n"
      "| Wed | 9:00 | 17:00 |\n| Thu | 9:00 | 17:00 |\n| Fri | 9:00 | 17:00 |\n| Sat | Closed | Closed |",
      "Opening hours table?", "table with identical rows but the day"),
    c("| Model | Supports streaming |\n|---|---|\n| A | Yes |\n| B | Yes |\n| C | Yes |\n| D | Yes |\n| E | No |",
      "Which models stream?", "yes column"),
    c("| x | x² | x³ |\n|---|---|---|\n| 1 | 1 | 1 |\n| 2 | 4 | 8 |\n| 3 | 9 | 27 |\n| 4 | 16 | 64 |",
      "Table of squares and cubes.", "numeric table"),
    # Poems, lyrics, refrains.
    c("Row, row, row your boat,\nGently down the stream.\nMerrily, merrily, merrily, merrily,\nLife is but a dream.",
      "Write the nursery rhyme Row Row Row Your Boat.", "nursery rhyme with repetition"),
    c("When the night is long and cold,\nI will hold on, I will hold on.\nWhen the road is steep and old,\n"
      "I will hold on, I will hold on.\n\nHold on, hold on,\nthe morning's coming soon.\nHold on, hold on,\n"
      "beneath the silver moon.\n\nWhen the rain won't let me go,\nI will hold on, I will hold on.",
      "Write a song with a chorus about perseverance.", "lyrics with refrain"),
    c("The sea, the sea, the endless sea,\nit calls to you, it calls to me.\nThe sea, the sea, the endless sea,\n"
      "it sings of what we used to be.", "A short poem about the sea.", "poem with refrain"),
    c("Twinkle, twinkle, little star,\nHow I wonder what you are!\nUp above the world so high,\n"
      "Like a diamond in the sky.\nTwinkle, twinkle, little star,\nHow I wonder what you are!",
      "Recite Twinkle Twinkle Little Star.", "refrain repeated"),
    c("Ho ho ho! Merry Christmas, everyone!", "What does Santa say?", "interjection repeat"),
    c("Na na na na, na na na na, hey hey hey, goodbye!", "Sing the chorus of 'Na Na Hey Hey Kiss Him Goodbye'.",
      "lyrics with na na"),
    c("An old silent pond...\nA frog jumps into the pond—\nsplash! Silence again.", "Write a haiku.", "haiku"),
    c("Work, work, work — that's all he ever did.", "Describe a workaholic in one line.", "triple word"),
    # Chinese.
    c("你好！很高兴见到你。", "用一句话打个招呼。", "Chinese greeting"),
    c("北京是中华人民共和国的首都，也是全国的政治、文化和国际交往中心。", "中国的首都是哪里？", "Chinese sentence"),
    c("光合作用是绿色植物利用光能，把二氧化碳和水转化为葡萄糖并释放氧气的过程。这个过程主要发生在叶绿体中。",
      "简单解释一下光合作用。", "Chinese explanation"),
    c("步骤如下：\n1. 打开设置。\n2. 点击“账户”。\n3. 选择“安全”。\n4. 点击“忘记密码”。", "怎么重置密码？", "Chinese list"),
    c("可以使用 Python 的 `requests` 库发送 HTTP 请求：\n\n```python\nimport requests\nr = requests.get(\"https://example.com\")\n"
      "print(r.status_code)\n```", "Python 怎么发 HTTP 请求？", "Chinese with code"),
    c("床前明月光，疑是地上霜。\n举头望明月，低头思故乡。", "背一首李白的《静夜思》。", "classical poem"),
    c("答案是 42。", "6 乘以 7 等于多少？", "Chinese short answer with digits"),
    c("机器学习（Machine Learning）是人工智能的一个分支，它让计算机从数据中学习规律，而不是依靠人工编写的规则。"
      "常见的方法包括监督学习、无监督学习和强化学习。", "什么是机器学习？", "Chinese with English term"),
    c("| 城市 | 人口（万） |\n|---|---|\n| 上海 | 2487 |\n| 北京 | 2189 |\n| 深圳 | 1756 |", "列出三个大城市的人口。",
      "Chinese table"),
    c("好的。", "回复“好的”。", "very short Chinese"),
    c("三角形的内角和是 180 度。", "三角形内角和是多少？", "Chinese maths"),
    c("推测解码（speculative decoding）先用小模型起草多个 token，再由大模型一次性验证，从而在不改变输出的前提下提高速度。",
      "用一句话解释推测解码。", "Chinese with English term"),
    c("<think>\n用户想要一句简短的问候。\n</think>\n\n你好！", "用一句话打招呼。", "Chinese with think block",
      thinking=True),
    # Japanese.
    c("こんにちは！今日はいい天気ですね。", "日本語で挨拶してください。", "Japanese greeting"),
    c("東京は日本の首都で、人口は約1400万人です。", "日本の首都はどこですか？", "Japanese with kanji and digits"),
    c("コーヒーとケーキをください。", "カフェで注文する文を教えて。", "katakana"),
    c("はい、できます。Pythonでは `sorted()` を使ってリストを並べ替えられます。", "Pythonでリストをソートできますか？",
      "Japanese with Latin code"),
    # Korean.
    c("안녕하세요! 만나서 반갑습니다.", "한국어로 인사해 주세요.", "Korean greeting"),
    c("서울은 대한민국의 수도입니다.", "한국의 수도는 어디인가요?", "Korean sentence"),
    # Spanish.
    c("¡Hola! ¿Cómo estás?", "Saluda en una frase corta.", "Spanish greeting"),
    c("La fotosíntesis es el proceso mediante el cual las plantas convierten la luz solar, el agua y el dióxido "
      "de carbono en glucosa y oxígeno.", "¿Qué es la fotosíntesis?", "Spanish explanation"),
    c("Pasos:\n1. Abre la aplicación.\n2. Ve a Ajustes.\n3. Pulsa «Cerrar sesión».", "¿Cómo cierro sesión?",
      "Spanish list"),
    c("Sí.", "¿Es Madrid la capital de España?", "Spanish one word"),
    # German.
    c("Guten Tag! Wie kann ich Ihnen helfen?", "Begrüße mich kurz.", "German greeting"),
    c("Die Hauptstadt von Deutschland ist Berlin. Sie hat etwa 3,7 Millionen Einwohner und ist für ihre "
      "Geschichte, Museen und Clubkultur bekannt.", "Was ist die Hauptstadt Deutschlands?", "German explanation"),
    c("Ich sehe das.", "Sag 'I see that' auf Deutsch.", "German ends on pronoun"),
    c("Straße, Größe, Übung und Fußgänger enthalten Umlaute oder ß.", "Nenne deutsche Wörter mit Umlauten.",
      "German umlauts"),
    # French.
    c("Bonjour ! Comment ça va ?", "Dis bonjour en une phrase.", "French greeting"),
    c("La tour Eiffel a été construite pour l'Exposition universelle de 1889 et mesure environ 330 mètres.",
      "Parle-moi de la tour Eiffel.", "French fact"),
    # Russian.
    c("Привет! Рад тебя видеть.", "Поздоровайся одним предложением.", "Russian greeting"),
    c("Москва — столица России и крупнейший город страны с населением более 13 миллионов человек.",
      "Какая столица России?", "Russian sentence"),
    c("Шаги:\n1. Откройте настройки.\n2. Выберите «Безопасность».\n3. Нажмите «Сменить пароль».",
      "Как сменить пароль?", "Russian list"),
    c("Используйте `git rebase -i HEAD~3`, чтобы объединить три последних коммита.", "Как объединить коммиты в git?",
      "Russian with code"),
    # Arabic, Hindi, Greek, Hebrew.
    c("مرحباً! كيف يمكنني مساعدتك اليوم؟", "قل مرحباً بجملة قصيرة.", "Arabic greeting"),
    c("नमस्ते! आप कैसे हैं?", "हिंदी में नमस्ते कहो।", "Hindi greeting"),
    c("Καλημέρα! Τι κάνεις;", "Πες καλημέρα.", "Greek greeting"),
    c("שלום! מה שלומך?", "תגיד שלום.", "Hebrew greeting"),
    # Translation / language questions (mixed scripts asked for).
    c("\"Good morning\" in Chinese is 早上好 (zǎoshang hǎo).", "How do you say good morning in Chinese?",
      "translation to Chinese"),
    c("English: I love reading books.\n中文：我喜欢读书。", "Translate 'I love reading books' into Chinese.",
      "side-by-side translation"),
    c("Hello — 你好 — こんにちは — Привет — Hola — مرحبا", "Say hello in six languages.", "multilingual hello"),
    c("Спасибо means \"thank you\" in Russian.", "What does Спасибо mean?", "prompt contains the Cyrillic word"),
    c("The Japanese word 木漏れ日 (komorebi) describes sunlight filtering through leaves.",
      "Tell me an untranslatable word.", "glossed Japanese term"),
    c("In Japanese you say ありがとう (arigatō) to thank someone.", "How do you say thanks in Japanese?",
      "Japanese word in English answer"),
    c("The character 水 means \"water\"; it is pronounced shuǐ in Mandarin.", "What does the kanji for water look like?",
      "single Han character"),
    c("I love you = 我爱你 (wǒ ài nǐ)", "Translate I love you to Mandarin.", "equation-style translation"),
    c("Der Satz bedeutet: \"The weather is nice today.\"", "Was bedeutet 'Das Wetter ist heute schön' auf Englisch?",
      "German prompt, English quote"),
    c("这句话的英文是：\"Practice makes perfect.\"", "“熟能生巧”用英语怎么说？", "Chinese prompt, English quote"),
    c("Privet (Привет) is the informal Russian greeting; Zdravstvuyte (Здравствуйте) is the formal one.",
      "How do Russians say hello?", "Cyrillic in parentheses"),
    c("In Chinese culture the word 福 (fú, luck) is hung upside down at New Year.", "Tell me about a Chinese "
      "New Year custom.", "culture with glossed character"),
    c("The concept of 'ubuntu' and the Korean 정 (jeong) both describe deep social bonds.",
      "Describe a concept of social bonds from another culture.", "Korean term glossed"),
    c("Tsundoku (積ん読) is buying books and letting them pile up unread.", "A fun word for buying too many books?",
      "Japanese in parentheses"),
    c("The term “气” is central to traditional Chinese medicine.", "What is qi?", "quoted Chinese term"),
    c("Its Greek name, «Ἑλλάς», is still used in formal contexts.", "What is Greece called in Greek?",
      "Greek quoted"),
    # Emoji, URLs, misc.
    c("🎉 Congratulations on your new job! 🎉 Wishing you all the best. 🚀", "Congratulate me.", "emoji"),
    c("Check https://example.com/path?q=1&lang=en#top for details, or email hello@example.org.",
      "Where can I find details?", "URL with query"),
    c("C:\\Users\\me\\Documents\\report.docx", "Show a Windows path.", "backslashes"),
    c("Version 1.2.3 fixes the crash; 1.2.4 adds dark mode.", "What changed in the last two releases?",
      "version numbers"),
    c("Ctrl+C copies, Ctrl+V pastes, Ctrl+Z undoes.", "Basic shortcuts?", "repeated Ctrl"),
    c("“Be yourself; everyone else is already taken.” — Oscar Wilde", "Give me a quote.", "quote with dash"),
    # Dialogue when it was asked for.
    c("User: Hi, I need help resetting my password.\nAssistant: Sure! Click \"Forgot password\" on the login "
      "page and follow the e-mail link.\nUser: Thanks!\nAssistant: You're welcome.",
      "Write a short example conversation between a user and an assistant.", "requested dialogue"),
    c("Interviewer: Why do you want this job?\nCandidate: I enjoy solving data problems and your team works on "
      "exactly that.", "Write a two-line interview transcript.", "transcript"),
    c("Log in with these demo credentials:\nUser: demo\nPassword: demo123", "What are the demo credentials?",
      "User: as a form field"),
    # Truncated by length, otherwise fine.
    c("Photosynthesis is the process by which plants convert light energy into chemical energy. It takes "
      "place in the chloroplasts, where chlorophyll absorbs", "Explain photosynthesis.", "cut by length",
      finish_reason="length", completion_tokens=32, max_tokens=32),
    c("Here is a Python function that reverses a string:\n\n```python\ndef reverse(s: str) -> str:\n    return s[",
      "Reverse a string in Python.", "cut inside code", finish_reason="length"),
    c("你好！我是一个由人工智能驱动的助手，可以回答问题、写作、翻译以及", "介绍一下你自己。", "Chinese cut by length",
      finish_reason="length"),
    c("The three laws of thermodynamics are:\n1. Energy cannot be created or destroyed.\n2. The entropy of an",
      "State the laws of thermodynamics.", "list cut by length", finish_reason="length"),
    c("Hello! How can I", STORY_PROMPT, "cut at max_tokens=5", finish_reason="length", completion_tokens=5,
      max_tokens=5),
    c("<think>\nThe user wants a greeting. I should keep it short and friendly, maybe", STORY_PROMPT,
      "thinking cut by length before the answer", finish_reason="length", thinking=True),
    c("", STORY_PROMPT, "empty answer: all tokens spent in separated reasoning", finish_reason="length",
      thinking=True, reasoning="The user wants a short greeting. Let me think about the tone and"),
    # Thinking done right.
    c("<think>\nA short greeting is needed. \"Hello!\" works.\n</think>\n\nHello! Nice to meet you.", STORY_PROMPT,
      "think block then answer", thinking=True),
    c("Okay, the user wants a short hello. Keep it simple.\n</think>\n\nHello there!", STORY_PROMPT,
      "pre-filled <think>: only the closing tag appears", thinking=True),
    c("Hello! 👋", STORY_PROMPT, "reasoning separated by the server", thinking=True,
      reasoning="The user asks for a one-sentence hello. A friendly, brief greeting fits."),
    c("The answer is 12.", "What is 3*4?", "think on, plain answer", thinking=True),
]

# Second batch, written before running the detector on it: longer answers, more languages.
CLEAN += [
    c("## Summary\n\nThe service returned **HTTP 503** because the upstream pool was exhausted.\n\n### Root cause\n\n1. A deploy at 14:02 doubled the worker count.\n2. Each worker opened 20 connections to the database.\n3. The database refused new connections after 500.\n\n### Fix\n\n- Lower `pool_size` to 10.\n- Add a circuit breaker in front of the DB client.\n- Alert when active connections exceed 80% of the limit.\n\n> The incident lasted 37 minutes; no data was lost.", "Write a short incident report for a 503 outage.", "long markdown report"),
    c("There are several ways to reverse a list in Python:\n\n```python\nnums = [1, 2, 3, 4]\n\n# 1. Slicing creates a new list\nrev = nums[::-1]\n\n# 2. reversed() returns an iterator\nrev = list(reversed(nums))\n\n# 3. list.reverse() works in place\nnums.reverse()\n```\n\nUse slicing when you need a copy, `reverse()` when you want to modify the original list, and `reversed()` when you only iterate.", "How do I reverse a list in Python?", "code with comments"),
    c("Great question! The main differences are:\n\n| | TCP | UDP |\n|---|---|---|\n| Connection | Yes | No |\n| Ordering | Guaranteed | Not guaranteed |\n| Reliability | Retransmits | Best effort |\n| Speed | Slower | Faster |\n| Use cases | Web, e-mail, SSH | DNS, video, games |\n\nIn short, pick TCP when every byte matters and UDP when latency matters more than completeness.", "TCP vs UDP?", "comparison table"),
    c("Here's a simple weekly meal plan:\n\n**Monday** – Grilled chicken with rice and broccoli\n**Tuesday** – Vegetable stir-fry with tofu\n**Wednesday** – Spaghetti bolognese\n**Thursday** – Salmon with roasted potatoes\n**Friday** – Homemade pizza\n**Saturday** – Bean chili with cornbread\n**Sunday** – Roast vegetables and couscous", "Give me a weekly meal plan.", "bold list"),
    c("To install the package:\n\n```bash\npip install ddtree-diag\n```\n\nThen run:\n\n```bash\nddtree-diag probe --url http://localhost:8000/v1\n```\n\nThe command prints a table with one row per probe and exits with code 1 if any check fails.", "How do I install and run it?", "multiple code blocks"),
    c("First, let's find the derivative of $f(x) = x^3 - 3x^2 + 2$:\n\n$$f'(x) = 3x^2 - 6x = 3x(x - 2)$$\n\nSetting $f'(x) = 0$ gives $x = 0$ or $x = 2$. Since $f''(x) = 6x - 6$, we have $f''(0) = -6 < 0$ (a local maximum) and $f''(2) = 6 > 0$ (a local minimum). So the local maximum is $f(0) = 2$ and the local minimum is $f(2) = -2$.", "Find the extrema of x^3-3x^2+2.", "calculus with LaTeX"),
    c("Roses are red,\nViolets are blue,\nSugar is sweet,\nAnd so are you.\n\nRoses are red,\nThe sky is so blue,\nWhatever the weather,\nI'm thinking of you.", "Write a roses are red poem with two stanzas.", "poem with repeated opening lines"),
    c("Happy birthday to you,\nHappy birthday to you,\nHappy birthday, dear Maya,\nHappy birthday to you!", "Write the happy birthday song for Maya.", "birthday song"),
    c("Of course. Here's the corrected sentence: \"Their house is bigger than ours, but they're selling it.\" The original mixed up *there*, *their* and *they're*.", "Fix: There house is bigger then ours, but their selling it.", "grammar fix"),
    c("Sure! Here are 10 names for a bakery:\n1. Rise & Shine\n2. The Rolling Pin\n3. Crumb & Co.\n4. Sugar Loaf\n5. Golden Crust\n6. Flour Power\n7. Knead to Know\n8. The Daily Loaf\n9. Butter Bliss\n10. Oven Fresh", "Suggest 10 bakery names.", "ten names"),
    c("```typescript\ninterface User {\n  id: number;\n  name: string;\n  email: string;\n}\n\nfunction greet(user: User): string {\n  return `Hello, ${user.name}!`;\n}\n```", "TypeScript interface example.", "typescript"),
    c("```kotlin\nfun main() {\n    val xs = listOf(1, 2, 3)\n    xs.forEach { println(it) }\n}\n```", "Kotlin loop", "kotlin"),
    c("```ruby\n[1, 2, 3].each do |n|\n  puts n * 2\nend\n```", "Ruby each", "ruby"),
    c("```haskell\nfib :: Int -> Integer\nfib 0 = 0\nfib 1 = 1\nfib n = fib (n - 1) + fib (n - 2)\n```", "Haskell fib", "haskell"),
    c("```dockerfile\nFROM python:3.12-slim\nWORKDIR /app\nCOPY requirements.txt .\nRUN pip install -r requirements.txt\nCOPY . .\nCMD [\"python\", \"main.py\"]\n```", "Dockerfile for a Python app", "dockerfile"),
    c("```\n$ ls -la\ntotal 16\ndrwxr-xr-x  4 user user 4096 Jan  1 12:00 .\ndrwxr-xr-x 20 user user 4096 Jan  1 12:00 ..\n-rw-r--r--  1 user user  220 Jan  1 12:00 .bashrc\n-rw-r--r--  1 user user  807 Jan  1 12:00 .profile\n```", "Show example ls -la output", "terminal output with repeated user"),
    c("量子计算利用量子比特（qubit）的叠加和纠缠特性进行计算。与经典比特只能是 0 或 1 不同，量子比特可以同时处于两种状态的叠加。\n\n主要应用包括：\n1. 密码学：Shor 算法可以分解大整数。\n2. 搜索：Grover 算法加速无序搜索。\n3. 化学模拟：模拟分子结构。", "什么是量子计算？", "long Chinese with list"),
    c("当然可以！下面是一个简单的 Python 函数：\n\n```python\ndef add(a, b):\n    \"\"\"返回两个数的和。\"\"\"\n    return a + b\n```\n\n调用 `add(2, 3)` 会返回 `5`。", "写一个 Python 加法函数。", "Chinese with code and docstring"),
    c("春眠不觉晓，处处闻啼鸟。\n夜来风雨声，花落知多少。", "背诵《春晓》。", "classical Chinese poem"),
    c("机器学习的三种主要类型：\n- 监督学习：使用带标签的数据。\n- 无监督学习：使用无标签的数据。\n- 强化学习：通过奖励来学习。", "机器学习有哪几种类型？", "Chinese list with repeated structure"),
    c("人工知能（AI）とは、人間の知的な振る舞いをコンピュータで再現する技術です。代表的な分野には、機械学習、自然言語処理、画像認識などがあります。", "人工知能とは何ですか？", "Japanese with parenthesised Latin"),
    c("はい、そうです。", "東京は日本の首都ですか？", "short Japanese"),
    c("Машинное обучение — это раздел искусственного интеллекта, который изучает методы построения алгоритмов, способных обучаться на данных. Например, модель может научиться распознавать спам в электронной почте.", "Что такое машинное обучение?", "long Russian"),
    c("Да, конечно.", "Ты можешь помочь?", "short Russian"),
    c("Die drei wichtigsten Schritte sind:\n1. Daten sammeln\n2. Modell trainieren\n3. Ergebnisse auswerten\n\nViel Erfolg!", "Wie trainiere ich ein Modell?", "German list"),
    c("Para preparar una tortilla española necesitas huevos, patatas, cebolla, aceite de oliva y sal. Primero fríe las patatas y la cebolla a fuego lento; luego mézclalas con los huevos batidos y cuaja la tortilla por ambos lados.", "¿Cómo se hace una tortilla española?", "Spanish recipe"),
    c("Voici une recette simple : mélangez 200 g de farine, 3 œufs et 50 cl de lait, puis laissez reposer la pâte une heure avant de cuire les crêpes.", "Comment faire des crêpes ?", "French recipe"),
    c("안녕하세요! 오늘 무엇을 도와드릴까요?", "안녕하세요", "Korean reply"),
    c("Xin chào! Tôi có thể giúp gì cho bạn?", "Chào bạn", "Vietnamese (Latin with diacritics)"),
    c("Merhaba! Size nasıl yardımcı olabilirim?", "Merhaba", "Turkish"),
    c("The Japanese phrase 「いただきます」 is said before meals to express gratitude.", "What do people say before eating?", "Japanese in corner brackets"),
    c("Mount Fuji (富士山, Fujisan) is Japan's tallest peak at 3,776 m.", "Tallest mountain in Japan?", "name with native script in parentheses"),
    c("“Dasvidaniya” (до свидания) means goodbye.", "How do you say goodbye?", "Cyrillic in parentheses"),
    c("The Greek letter Ω (omega) is used for ohms, and μ for micro-, as in 5 μF.", "Greek letters in electronics?", "Greek symbols"),
    c("Temperatures range from −5 °C to 35 °C, i.e. 23 °F to 95 °F.", "Temperature range in °F?", "units and minus sign"),
    c("✅ Tests passed\n✅ Lint passed\n✅ Build passed\n❌ Deploy failed", "CI summary with emoji", "emoji status lines"),
    c("Sure: https://github.com/pytorch/pytorch/issues?q=is%3Aissue+is%3Aopen+label%3Abug", "Link to open pytorch bugs", "long URL with escapes"),
    c("Yes — and no. It depends on the batch size.", "Is speculative decoding always faster?", "short nuanced"),
    c("Thanks!", "You did great.", "two-word reply"),
    c("Done.", "Confirm you received this.", "one word"),
    c("Hi! 👋 How's it going?", "hey", "greeting with emoji"),
    c("Lo siento, no puedo ayudar con eso.", "Hazme un virus.", "Spanish refusal"),
    c("<think>\nThe user asks for 2+2. That's 4.\n</think>\n\n2 + 2 = 4.", "What is 2+2?", "think block with maths", thinking=True),
    c("The photosynthesis equation is 6CO₂ + 6H₂O → C₆H₁₂O₆ + 6O₂.", "Photosynthesis equation?", "chemistry with subscripts"),
    c("Sure! Here's a limerick:\n\nThere once was a coder named Lee,\nWho drank far too much of his tea.\nHe typed with great speed,\nAs fast as a steed,\nBut his code was as buggy as could be.", "Write a limerick about a programmer.", "limerick"),
    c("Here's the requested output:\n\nyes\nyes\nno\nyes\nno", "For each of 5 numbers 2,4,7,8,9 say yes if even, one per line.", "short repeated answers, asked for"),
    c("A: 1\nB: 1\nC: 1\nD: 2", "Count letters in 'ABCDD'.", "counting table"),
]

# Third batch, written before running the detector on it (two misses then fixed in the
# detector; one ambiguous garbled sample dropped, see the bench notes).
CLEAN += [
    c("Verse 1:\nI walked along the empty shore\nThe waves were calling out my name\n\nChorus:\nOh, come back home, come back home\nThe light is on, you're not alone\nOh, come back home, come back home\nThe light is on, you're not alone\n\nVerse 2:\nThe stars were fading one by one", 'Write a song about coming home with a chorus.', 'third batch, written blind 1', finish_reason='length'),
    c('```python\nimport unittest\n\nclass TestAdd(unittest.TestCase):\n    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n\n    def test_one(self):\n        self.assertEqual(add(1, 0), 1)\n\n    def test_two(self):\n        self.assertEqual(add(1, 1), 2)\n```', 'Write unit tests for add()', 'third batch, written blind 2', finish_reason='stop'),
    c('| Country | Capital | Continent |\n|---|---|---|\n| France | Paris | Europe |\n| Germany | Berlin | Europe |\n| Italy | Rome | Europe |\n| Spain | Madrid | Europe |\n| Japan | Tokyo | Asia |\n| China | Beijing | Asia |', 'Table of countries and capitals', 'third batch, written blind 3', finish_reason='stop'),
    c('SELECT name FROM users;\nSELECT name FROM admins;\nSELECT name FROM guests;', 'Three queries listing names', 'third batch, written blind 4', finish_reason='stop'),
    c('Monday: 8 hours\nTuesday: 8 hours\nWednesday: 8 hours\nThursday: 8 hours\nFriday: 6 hours', 'Hours worked per day?', 'third batch, written blind 5', finish_reason='stop'),
    c('The word "the" is the most common word in English; "the the" is a common typo.', 'Most common English word?', 'third batch, written blind 6', finish_reason='stop'),
    c('1. Introduction\n2. Methods\n3. Results\n4. Discussion\n5. Conclusion', 'Sections of a paper?', 'third batch, written blind 7', finish_reason='stop'),
    c('a) True\nb) False\nc) True\nd) True', 'Answer the 4 true/false questions.', 'third batch, written blind 8', finish_reason='stop'),
    c('To convert Celsius to Fahrenheit, multiply by 9/5 and add 32: 0 °C = 32 °F, 100 °C = 212 °F, and 37 °C = 98.6 °F.', 'C to F?', 'third batch, written blind 9', finish_reason='stop'),
    c('Pour la liste :\n- pommes\n- poires\n- bananes', 'Liste de fruits', 'third batch, written blind 10', finish_reason='stop'),
    c('Конечно! Вот пример кода на Python:\n\n```python\nprint("Привет, мир!")\n```', 'Напиши Hello World на Python', 'third batch, written blind 11', finish_reason='stop'),
    c('请看下面的表格：\n\n| 名称 | 数量 |\n|---|---|\n| 苹果 | 3 |\n| 香蕉 | 5 |', '做一个水果表格', 'third batch, written blind 12', finish_reason='stop'),
    c('日本の四季は、春、夏、秋、冬です。', '日本の四季は？', 'third batch, written blind 13', finish_reason='stop'),
    c('Sure! Here is the JSON:\n\n{"status": "ok", "items": [1, 2, 3], "next": null}', 'Return JSON', 'third batch, written blind 14', finish_reason='stop'),
    c('Yes! 🎉🎉🎉', 'Did I pass?', 'third batch, written blind 15', finish_reason='stop'),
    c('Use `git log --oneline --graph --all` to see the history as a graph.', 'git history graph?', 'third batch, written blind 16', finish_reason='stop'),
    c('<think>\nLet me count: 1, 2, 3, 4, 5.\nSo five.\n</think>\n\nThere are 5.', 'How many fingers on one hand?', 'third batch, written blind 17', finish_reason='stop'),
    c("Hmm, that's a tricky one. I'd say yes, but it depends on context.", 'Is it ok to...?', 'third batch, written blind 18', finish_reason='stop'),
    c("Here's a quick summary:\n\n- **Pros:** fast, cheap\n- **Cons:** fragile\n\nOverall: worth trying.", 'Summarize', 'third batch, written blind 19', finish_reason='stop'),
    c('E = mc²', "Einstein's famous equation?", 'third batch, written blind 20', finish_reason='stop'),
    c('Das Wort "Kindergarten" wurde ins Englische übernommen.', 'Deutsches Lehnwort im Englischen?', 'third batch, written blind 21', finish_reason='stop'),
    c('नमस्ते! मैं आपकी कैसे मदद कर सकता हूँ?', 'नमस्ते', 'third batch, written blind 22', finish_reason='stop'),
    c('مرحبا! أنا بخير، شكرا لك.', 'كيف حالك؟', 'third batch, written blind 23', finish_reason='stop'),
    c('Ciao! Come stai?', 'Saluta in italiano', 'third batch, written blind 24', finish_reason='stop'),
    c('Olá! Tudo bem?', 'Diga olá em português', 'third batch, written blind 25', finish_reason='stop'),
    c('The sequence is: 1, 1, 2, 3, 5, 8, 13, 21, 34, 55.', 'First 10 Fibonacci numbers', 'third batch, written blind 26', finish_reason='stop'),
    c('Binary for 255 is 11111111.', '255 in binary', 'third batch, written blind 27', finish_reason='stop'),
    c('1 1 1\n1 1 1\n1 1 1', '3x3 matrix of ones, space separated', 'third batch, written blind 28', finish_reason='stop'),
    c("I'm sorry, I don't know.", "What's my cat's name?", 'third batch, written blind 29', finish_reason='stop'),
    c('Sure.', 'Can you help?', 'third batch, written blind 30', finish_reason='stop'),
]

# Fourth batch, written before running the detector on it: more languages, code, logs.
CLEAN += [
    c('Olá! Claro, posso ajudar. O Brasil tem 26 estados e um Distrito Federal.', 'Quantos estados tem o Brasil?', 'fourth batch, written blind 1', finish_reason='stop'),
    c("Certo! La capitale d'Italia è Roma, che ha circa 2,8 milioni di abitanti.", "Qual è la capitale d'Italia?", 'fourth batch, written blind 2', finish_reason='stop'),
    c('De hoofdstad van Nederland is Amsterdam, maar de regering zit in Den Haag.', 'Wat is de hoofdstad van Nederland?', 'fourth batch, written blind 3', finish_reason='stop'),
    c('Stolicą Polski jest Warszawa.', 'Jaka jest stolica Polski?', 'fourth batch, written blind 4', finish_reason='stop'),
    c("Türkiye'nin başkenti Ankara'dır.", "Türkiye'nin başkenti neresidir?", 'fourth batch, written blind 5', finish_reason='stop'),
    c('Thủ đô của Việt Nam là Hà Nội.', 'Thủ đô của Việt Nam là gì?', 'fourth batch, written blind 6', finish_reason='stop'),
    c('Ibu kota Indonesia adalah Jakarta.', 'Apa ibu kota Indonesia?', 'fourth batch, written blind 7', finish_reason='stop'),
    c('भारत की राजधानी नई दिल्ली है।', 'भारत की राजधानी क्या है?', 'fourth batch, written blind 8', finish_reason='stop'),
    c('عاصمة مصر هي القاهرة.', 'ما هي عاصمة مصر؟', 'fourth batch, written blind 9', finish_reason='stop'),
    c('בירת ישראל היא ירושלים.', 'מהי בירת ישראל?', 'fourth batch, written blind 10', finish_reason='stop'),
    c('เมืองหลวงของประเทศไทยคือกรุงเทพมหานคร', 'เมืองหลวงของประเทศไทยคืออะไร', 'fourth batch, written blind 11', finish_reason='stop'),
    c('Столиця України — Київ.', 'Яка столиця України?', 'fourth batch, written blind 12', finish_reason='stop'),
    c('```cpp\n#include <iostream>\n#include <vector>\n\nint main() {\n    std::vector<int> v{1, 2, 3};\n    for (auto x : v) {\n        std::cout << x << std::endl;\n    }\n    return 0;\n}\n```', 'C++ vector loop', 'fourth batch, written blind 13', finish_reason='stop'),
    c('```java\npublic class Main {\n    public static void main(String[] args) {\n        System.out.println("Hello");\n        System.out.println("World");\n    }\n}\n```', 'Java hello world on two lines', 'fourth batch, written blind 14', finish_reason='stop'),
    c('```swift\nlet names = ["Ana", "Bo"]\nfor name in names {\n    print("Hi, \\(name)!")\n}\n```', 'Swift loop', 'fourth batch, written blind 15', finish_reason='stop'),
    c("```php\n<?php\n$items = ['a', 'b', 'c'];\nforeach ($items as $item) {\n    echo $item . PHP_EOL;\n}\n```", 'PHP foreach', 'fourth batch, written blind 16', finish_reason='stop'),
    c('```lua\nfor i = 1, 3 do\n  print(i)\nend\n```', 'Lua loop', 'fourth batch, written blind 17', finish_reason='stop'),
    c('```r\nx <- c(1, 2, 3)\nmean(x)\n```', 'R mean', 'fourth batch, written blind 18', finish_reason='stop'),
    c('```asm\nmov eax, 1\nmov ebx, 0\nint 0x80\n```', 'Linux exit syscall in asm', 'fourth batch, written blind 19', finish_reason='stop'),
    c('```diff\n- old line\n+ new line\n  unchanged\n- removed\n+ added\n```', 'Show a diff', 'fourth batch, written blind 20', finish_reason='stop'),
    c('```\nTraceback (most recent call last):\n  File "main.py", line 3, in f\n    return f(n)\n  File "main.py", line 3, in f\n    return f(n)\n  File "main.py", line 3, in f\n    return f(n)\n  [Previous line repeated 996 more times]\nRecursionError: maximum recursion depth exceeded\n```\n\nYour function never reaches a base case.', 'Why does my recursive function crash?', 'fourth batch, written blind 21', finish_reason='stop'),
    c('Traceback (most recent call last):\n  File "app.py", line 12, in <module>\n    main()\n  File "app.py", line 8, in main\n    run()\nKeyError: \'user\'', 'Explain this error', 'fourth batch, written blind 22', finish_reason='stop'),
    c('id,name,score\n1,alice,90\n2,bob,85\n3,carol,90\n4,dave,85', 'Give me sample CSV data', 'fourth batch, written blind 23', finish_reason='stop'),
    c('2024-05-01 12:00:01 INFO Worker 1 started\n2024-05-01 12:00:01 INFO Worker 2 started\n2024-05-01 12:00:02 INFO Worker 3 started\n2024-05-01 12:00:02 INFO Worker 4 started', 'Example log output for 4 workers starting', 'fourth batch, written blind 24', finish_reason='stop'),
    c('<ul>\n  <li><a href="/">Home</a></li>\n  <li><a href="/about">About</a></li>\n  <li><a href="/contact">Contact</a></li>\n</ul>', 'HTML nav menu', 'fourth batch, written blind 25', finish_reason='stop'),
    c('<?xml version="1.0"?>\n<config>\n  <item key="a">1</item>\n  <item key="b">1</item>\n  <item key="c">1</item>\n</config>', 'Sample XML config', 'fourth batch, written blind 26', finish_reason='stop'),
    c('The regex `^\\d{3}-\\d{4}$` matches strings like 555-1234.', 'Regex for phone numbers?', 'fourth batch, written blind 27', finish_reason='stop'),
    c('$ mkdir demo && cd demo\n$ git init\nInitialized empty Git repository in /home/user/demo/.git/\n$ git status\nOn branch main', 'Show a shell session creating a git repo', 'fourth batch, written blind 28', finish_reason='stop'),
    c("\\begin{align}\nf(x) &= x^2 \\\\\nf'(x) &= 2x \\\\\nf''(x) &= 2\n\\end{align}", 'Derivatives of x^2 in LaTeX align', 'fourth batch, written blind 29', finish_reason='stop'),
    c('The matrix is\n$$\\begin{pmatrix} 1 & 0 & 0 \\\\ 0 & 1 & 0 \\\\ 0 & 0 & 1 \\end{pmatrix}$$', '3x3 identity in LaTeX', 'fourth batch, written blind 30', finish_reason='stop'),
    c('Yes. No. Maybe.', 'Give three possible answers', 'fourth batch, written blind 31', finish_reason='stop'),
    c('A\nB\nC\nD', 'First four letters, one per line', 'fourth batch, written blind 32', finish_reason='stop'),
    c("Sure! Here's a tongue twister: She sells seashells by the seashore.", 'Tongue twister?', 'fourth batch, written blind 33', finish_reason='stop'),
    c('Peter Piper picked a peck of pickled peppers; a peck of pickled peppers Peter Piper picked.', 'A classic tongue twister', 'fourth batch, written blind 34', finish_reason='stop'),
    c('Mmm, delicious! 😋', 'How was the cake?', 'fourth batch, written blind 35', finish_reason='stop'),
    c('Happy New Year! 新年快乐！🎆', 'Wish me happy new year in English and Chinese', 'fourth batch, written blind 36', finish_reason='stop'),
    c('The password must contain: 1) 8+ characters, 2) a digit, 3) a symbol.', 'Password rules?', 'fourth batch, written blind 37', finish_reason='stop'),
    c('- [ ] Task\n- [ ] Task\n- [ ] Task', 'Three empty task checkboxes in markdown', 'fourth batch, written blind 38', finish_reason='stop'),
    c('Dear team,\n\nPlease find the report attached.\n\nBest,\nSam', 'Short email with attachment', 'fourth batch, written blind 39', finish_reason='stop'),
    c('It depends. If x > 0, return x; otherwise, return -x.', 'abs value logic', 'fourth batch, written blind 40', finish_reason='stop'),
]

# Programmatically varied clean texts: long lists with a fixed shape and different content.
_VERBS = ["Open", "Read", "Check", "Update", "Restart", "Back up", "Verify", "Delete", "Rename", "Upload",
          "Compress", "Review", "Merge", "Tag", "Deploy", "Monitor"]
_OBJECTS = ["the config file", "the error log", "the disk usage", "the package index", "the web server",
            "the database", "the TLS certificate", "old snapshots", "the release branch", "the build artefacts",
            "the cache directory", "the pull request", "the feature branch", "the new version",
            "the staging cluster", "the latency dashboards"]


def _generated_clean(rng: random.Random) -> list[dict]:
    out = []
    for k in range(10):
        steps = rng.sample(range(len(_VERBS)), 6 + k % 5)
        lines = [f"- Step {i + 1}: {_VERBS[s]} {_OBJECTS[(s + k) % len(_OBJECTS)]}." for i, s in enumerate(steps)]
        out.append(c("Runbook:\n" + "\n".join(lines), "Write a maintenance runbook.", f"generated step list {k}"))
    for k in range(6):
        rows = [f"| {name} | {rng.choice(['Yes', 'No'])} | {rng.choice(['Yes', 'No'])} | {rng.randint(1, 99)} |"
                for name in rng.sample(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"], 6)]
        out.append(c("| Name | Linux | macOS | Score |\n|---|---|---|---|\n" + "\n".join(rows),
                     "Tabulate support per platform.", f"generated yes/no table {k}"))
    for k in range(4):
        items = [f'  {{"key": "k{i}", "value": {rng.randint(0, 3)}, "enabled": {rng.choice(["true", "false"])}}}'
                 for i in range(8)]
        out.append(c("[\n" + ",\n".join(items) + "\n]", "Return the settings as a JSON array only.",
                     f"generated bare json array {k}"))
    return out


# ---------------------------------------------------------------------------------------------
# Garbled

STORY_THINKING = "Thinking to the 1. 1. 题目:\nuser:\n# user: 1.\n# 1. 1. 1. 年 1 1. 三角形\n1."

GARBLED = [
    # The story.
    g("Hello,", STORY_PROMPT, "story: thinking off, 3 tokens ending on a comma", completion_tokens=3, max_tokens=48,
      thinking=False),
    g(STORY_THINKING, STORY_PROMPT, "story: thinking on, 22 rounds of garbage", finish_reason="length",
      completion_tokens=48, max_tokens=48, thinking=True),
    # Replies that stop after a few tokens.
    g("Sure, here is", "Write a haiku about autumn.", "stopped mid-sentence", completion_tokens=3),
    g("The capital of France is", "What is the capital of France?", "stopped before the answer", completion_tokens=5),
    g("Here is the code:", "Write a Python function that adds two numbers.", "stopped after announcing code",
      completion_tokens=5),
    g("你好，", "用一句话打个招呼。", "Chinese reply stopped on a comma", completion_tokens=2),
    g("Hola,", "Saluda en una frase corta.", "Spanish reply stopped on a comma", completion_tokens=2),
    g("The answer is the", "What is 2+2?", "stopped on an article", completion_tokens=4),
    g("Hi! I'm", "Introduce yourself briefly.", "stopped on a contraction", completion_tokens=3),
    g("Paris is the capital and", "Tell me about Paris.", "stopped on a conjunction", completion_tokens=5),
    g("1.", "List three fruits.", "list that stops at its first marker", completion_tokens=2),
    g("Step 1:", "How do I boil an egg?", "stopped after the first label", completion_tokens=3),
    g("```python\ndef add(a, b):", "Write add() in Python.", "code block opened and abandoned", completion_tokens=8),
    # Empty.
    g("", STORY_PROMPT, "empty answer with finish_reason stop", completion_tokens=0),
    g("   \n\n  ", "Explain recursion.", "whitespace only"),
    g("...", "What is the boiling point of water?", "punctuation only"),
    g("", "用一句话打个招呼。", "empty Chinese answer"),
    # Token loops.
    g("The the the the the the the the the the the the", "Describe a cat.", "single-word loop",
      finish_reason="length"),
    g("I think I think I think I think I think I think I think", "What do you think about AI?", "two-word loop",
      finish_reason="length"),
    g("\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n\ufffd\n",
      STORY_PROMPT, "two-token U+FFFD/newline loop", finish_reason="length"),
    g("Hello! \ufffd\ufffd", STORY_PROMPT, "broken multi-byte token at the end"),
    g("我的的的的的的的的的的的的的的的的的的的", "介绍一下你自己。", "Chinese single-character loop", finish_reason="length"),
    g("是是是是是是是是是是是是是", "这是真的吗？", "Chinese yes loop", finish_reason="length"),
    g("Привет! Привет! Привет! Привет! Привет! Привет! Привет!", "Поздоровайся одним предложением.",
      "Russian greeting loop", finish_reason="length"),
    g("Hello Hello Hello Hello Hello Hello Hello Hello", STORY_PROMPT, "greeting loop", finish_reason="length"),
    g("and and and and and and and and", "Summarize the plot of Hamlet.", "conjunction loop",
      finish_reason="length"),
    g("Bonjour bonjour bonjour bonjour bonjour bonjour", "Dis bonjour en une phrase.", "French loop",
      finish_reason="length"),
    # Line loops.
    g("Sure! Here is a list:\n- apples\n- apples\n- apples\n- apples\n- apples\n- apples\n- apples",
      "List five different fruits.", "bullet line loop", finish_reason="length"),
    g("def add(a, b):\n    return a + b\n    return a + b\n    return a + b\n    return a + b\n    return a + b\n",
      "Write add() in Python.", "code line loop (unfenced)", finish_reason="length"),
    g("第一步：打开设置。\n第一步：打开设置。\n第一步：打开设置。\n第一步：打开设置。\n第一步：打开设置。", "怎么重置密码？",
      "Chinese line loop", finish_reason="length"),
    g("Hello!\nHello!\nHello!\nHello!\nHello!\nHello!\nHello!\nHello!", STORY_PROMPT, "greeting line loop",
      finish_reason="length"),
    g("| Name | Age |\n|---|---|\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n"
      "| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |\n| Alice | 30 |",
      "Make a table of three people with their ages.", "table row loop", finish_reason="length"),
    # Counter loops (repeat with a changing number).
    g("Here are some facts:\n1. The sun is a star.\n2. The sun is a star.\n3. The sun is a star.\n4. The sun is a star.\n"
      "5. The sun is a star.\n6. The sun is a star.\n7. The sun is a star.\n8. The sun is a star.",
      "Give me five different facts about space.", "numbered loop with a changing counter", finish_reason="length"),
    g("- Step 1: Open the file and read the first line.\n- Step 2: Open the file and read the first line.\n"
      "- Step 3: Open the file and read the first line.\n- Step 4: Open the file and read the first line.\n"
      "- Step 5: Open the file and read the first line.", "How do I parse a CSV file?",
      "step list stuck on one step", finish_reason="length"),
    # Numbering loops.
    g("1. 1. 1. 1. 1. 1. 1. 1. 1. 1.", "List three fruits.", "numbering loop", finish_reason="length"),
    g("Here are three fruits:\n1.\n1.\n1.\n1.\n1.\n1.", "List three fruits.", "empty numbered items",
      finish_reason="length"),
    g("The steps are 1. 2. 2. 2. 2. 2. 2.", "How do I boil an egg?", "stuck counter", finish_reason="length"),
    g("答案：1. 1. 1. 1. 1. 1. 1.", "列出三种水果。", "Chinese numbering loop", finish_reason="length"),
    # Template leaks.
    g("Hello! How can I help you today?<|im_end|>\n<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n",
      STORY_PROMPT, "ChatML turn leak", finish_reason="length"),
    g("Hello there!<|im_end|>", STORY_PROMPT, "trailing im_end not stripped"),
    g("Hello!<|endoftext|>Human: what is 2+2", STORY_PROMPT, "endoftext then a new turn"),
    g("The capital of France is Paris.</s><s>[INST] What about Spain? [/INST]", "What is the capital of France?",
      "Llama-2 template leak"),
    g("Sure thing!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThanks", "Can you help me?",
      "Llama-3 header leak"),
    g("Hello!<end_of_turn>\n<start_of_turn>user\nhi", STORY_PROMPT, "Gemma turn leak"),
    g("你好！<|im_end|>\n<|im_start|>user\n谢谢<|im_end|>", "用一句话打个招呼。", "ChatML leak in Chinese"),
    g("<|im_start|>assistant\nHello!", STORY_PROMPT, "role header at the start"),
    g("Hi!<｜end▁of▁sentence｜><｜User｜>more", STORY_PROMPT, "DeepSeek full-width token leak"),
    g("The answer is 4.<|endoftext|><|endoftext|><|endoftext|><|endoftext|>", "What is 2+2?",
      "repeated endoftext", finish_reason="length"),
    g("Hello<|channel|>analysis<|message|>The user", STORY_PROMPT, "GPT-OSS channel leak"),
    g("Paris.\n[INST] What is the capital of Italy? [/INST]\nRome.", "What is the capital of France?",
      "INST markers"),
    # Role leaks without special tokens (stripped by the detokenizer).
    g("Hello! Nice to meet you.\nuser\nWhat's your name?\nassistant\nI'm an AI.", STORY_PROMPT,
      "ChatML leak with tokens stripped"),
    g("Hello!\n\nHuman: Tell me a joke.\n\nAssistant: Why did", STORY_PROMPT, "Human/Assistant continuation",
      finish_reason="length"),
    g("Paris is the capital.\n### Instruction:\nWhat is the capital of Spain?\n### Response:\nMadrid",
      "What is the capital of France?", "Alpaca headers"),
    g("Hi there!\n# user: hello\n# assistant: hi", STORY_PROMPT, "markdown role headings"),
    g("Sure.\nUser: and what about tomorrow?\nAssistant: Tomorrow will be sunny.", "What's the weather today?",
      "dialogue continuation"),
    g("Hello!\nuser:", STORY_PROMPT, "trailing user marker"),
    g("好的，我来回答。\nuser\n继续\nassistant\n好的", "解释一下递归。", "Chinese with stripped ChatML roles"),
    # Thinking leaks.
    g("<think>\n\n</think>\n\nHello!", STORY_PROMPT, "think block in the answer with thinking off", thinking=False),
    g("Hello!</think>", STORY_PROMPT, "closing think tag with thinking off", thinking=False),
    g("<think>\nThe user wants a greeting. Let me think about what to say. Maybe hello.", STORY_PROMPT,
      "unterminated think block, finish stop", thinking=True),
    g("<think>hi</think>Hello<think>again</think>", STORY_PROMPT, "repeated think blocks", thinking=True),
    g("<think>\nOk.\n</think>\nHello!", STORY_PROMPT, "tags in content although reasoning was separated",
      thinking=True, reasoning="Ok."),
    # Replacement, control characters, mojibake.
    g("Hello! I\ufffdm glad to help.", STORY_PROMPT, "replacement char in an apostrophe"),
    g("这是一个\ufffd\ufffd测试。", "说一句话。", "replacement chars inside Chinese"),
    g("Hello\x00 world\x00", STORY_PROMPT, "NUL characters"),
    g("The result is\x1b[0m 42\x08\x08.", "What is 6*7?", "escape and backspace"),
    g("Caf\x82 au lait\x85", "Name a French drink.", "C1 control characters"),
    g("L'Ã©tÃ© Ã  Paris est trÃ¨s chaud.", "Décris l'été à Paris.", "UTF-8 read as Latin-1"),
    g("Itâ€™s a beautiful day â€” enjoy it!", "Say something nice.", "cp1252 mojibake of curly quotes"),
    g("ÐŸÑ€Ð¸Ð²ÐµÑ‚! ÐšÐ°Ðº Ð´ÐµÐ»Ð°?", "Поздоровайся.", "Cyrillic mojibake"),
    g("ä½ å¥½ï¼\x81", "用一句话打个招呼。", "Chinese mojibake"),
    g("Die GrÃ¶ÃŸe ist Ã¼berraschend.", "Beschreibe die Größe.", "German mojibake"),
    # Script switches mid-sentence.
    g("The capital of France is Paris, which is known for 它的美丽的建筑和丰富的历史。", "What is the capital of France?",
      "switch to Chinese mid-sentence"),
    g("Photosynthesis converts light energy into 化学能 and releases oxygen.", "Explain photosynthesis.",
      "Chinese words mid-sentence"),
    g("Hello! How can I помочь вам сегодня?", STORY_PROMPT, "switch to Russian mid-sentence"),
    g("Sure, I can help with that. 그러나 먼저 질문을 확인하겠습니다.", "Can you help me with my homework?",
      "switch to Korean"),
    g("北京是中国的首都，also it is Москва的 sister city.", "中国的首都是哪里？", "Chinese answer switching to Cyrillic"),
    g("Die Hauptstadt ist Berlin, 柏林是一个城市 und sehr groß.", "Was ist die Hauptstadt Deutschlands?",
      "German answer with a Chinese clause"),
    g("Machine learning is a subset of AI that 让计算机从数据中学习 patterns.", "What is machine learning?",
      "mid-sentence Chinese clause"),
    g("Hеllо, hоw аrе yоu?", STORY_PROMPT, "Latin words with Cyrillic homoglyphs"),
    g("La fotosíntesis es el proceso по которому растения производят глюкозу.", "¿Qué es la fotosíntesis?",
      "Spanish switching to Russian"),
    g("Thinking about the question 题目 年 三角形 1.", STORY_PROMPT, "story-like fragments"),
    g("Привет! Я рад 你好 тебя видеть.", "Поздоровайся одним предложением.", "Russian with a Chinese word"),
    g("こんにちは！今日はいい天気ですね。Привет мир。", "日本語で挨拶してください。", "Japanese switching to Russian"),
    g("The answer is 四十二.", "What is 6 times 7?", "number written in Chinese"),
    g("Sure! The steps are: first, open the settings, 然后点击账户，最后选择安全。", "How do I reset my password?",
      "instructions switching to Chinese"),
]

# Second batch, written before running the detector on it.
GARBLED += [
    g("## Summary\n\nThe service returned **HTTP 503** because the upstream pool was exhausted.\n\n### Root cause\n\n1. A deploy at 14:02 doubled the worker count.\n2. A deploy at 14:02 doubled the worker count.\n3. A deploy at 14:02 doubled the worker count.\n4. A deploy at 14:02 doubled the worker count.\n5. A deploy at 14:02 doubled the worker count.\n6. A deploy", "Write a short incident report for a 503 outage.", "report that starts well then repeats a list item", finish_reason="length"),
    g("There are several ways to reverse a list in Python:\n\n```python\nnums = [1, 2, 3, 4]\nrev = nums[::-1]\n```\n\nUse slicing when you need a copy. Use slicing when you need a copy. Use slicing when you need a copy. Use slicing when you need a copy. Use slicing", "How do I reverse a list in Python?", "answer then sentence loop", finish_reason="length"),
    g("量子计算利用量子比特的叠加和纠缠特性进行计算。量子比特量子比特量子比特量子比特量子比特量子比特量子比特量子比特", "什么是量子计算？", "Chinese phrase loop", finish_reason="length"),
    g("Машинное обучение — это раздел искусственного интеллекта, 它研究从数据中学习的算法。", "Что такое машинное обучение?", "Russian switching to Chinese"),
    g("人工知能とは、人間の知的な振る舞いを Привет мир компьютер で再現する技術です。", "人工知能とは何ですか？", "Japanese with a Cyrillic burst"),
    g("Para preparar una tortilla española necesitas huevos, patatas 和洋葱，然后用橄榄油煎。", "¿Cómo se hace una tortilla española?", "Spanish into Chinese"),
    g("Sure! Here are 10 names for a bakery:\n1. Rise & Shine\n2.\n2.\n2.\n2.\n2.\n2.", "Suggest 10 bakery names.", "list that sticks on an empty item", finish_reason="length"),
    g("Great question! The main differences are:\n\n<|im_end|>", "TCP vs UDP?", "answer cut by a leaked end token"),
    g("To install the package:\n\n```bash\npip install ddtree-diag\n```<|endoftext|><|im_start|>system\nYou are a helpful assistant.", "How do I install it?", "leak after a code block"),
    g("First, let's find the derivative.\n\nuser\nthanks\nassistant\nYou're welcome!", "Find the extrema of x^3-3x^2+2.", "stripped ChatML turns after a start"),
    g("Happy birthday to you! Happy birthday to you! Happy birthday to you! Happy birthday to you! Happy birthday to you! Happy birthday to you! Happy birthday to you! Happy birthday to you!", "Say happy birthday once.", "greeting loop", finish_reason="length"),
    g("Of course. Here's the corrected sentence:", "Fix: There house is bigger then ours.", "stopped right after the announcement", completion_tokens=8),
    g("Sure! Here's a limerick:\n\nThere once was a coder named", "Write a limerick about a programmer.", "stopped inside the first line", completion_tokens=12),
    g("Da, konechno. Я могу помочь, но 我不知道 how.", "Can you help?", "three scripts in one sentence"),
    g("Hi! 👋 \ufffd\ufffd\ufffd How's it going?", "hey", "broken emoji bytes"),
    g("Merhaba! Size nasÄ±l yardÄ±mcÄ± olabilirim?", "Merhaba", "Turkish mojibake"),
    g("Thanks!\x1b[2K\x1b[1A", "You did great.", "terminal escape codes"),
    g("<think>\nThe user asks for 2+2.\n</think>\n\n2 + 2 = 4.\n<think>\nWait, let me re-check.\n</think>\n\n4.", "What is 2+2?", "a second think block after the answer", thinking=True),
    g("2 + 2 = 4.</think>", "What is 2+2?", "stray closing think tag with thinking off", thinking=False),
    g("Yes yes yes yes yes yes yes yes yes yes yes yes", "Is speculative decoding always faster?", "yes loop", finish_reason="length"),
    g("Here's the answer: 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4", "What is 2+2?", "number loop after a good start", finish_reason="length"),
    g("A café in Paris serves crêpes and café au lait. café café café café café café café café", "Describe a Paris café.", "accented word loop", finish_reason="length"),
    g("Assistant: Hello! How can I help you today?\nUser: Tell me a joke.\nAssistant: Why did the", "hey", "whole dialogue hallucinated", finish_reason="length"),
    g("The answer is:\n\n### Response:\n4", "What is 2+2?", "Alpaca response header in the answer"),
    g(".", "Explain recursion.", "a lone full stop"),
]

# Third batch, written before running the detector on it.
GARBLED += [
    g('Verse 1:\nI walked along the empty shore\nThe waves were calling out my name\nThe waves were calling out my name\nThe waves were calling out my name\nThe waves were calling out my name\nThe waves were calling out my name\nThe waves were calling out my name\nThe waves were calling out my name', 'Write a song about coming home with a chorus.', 'third batch, written blind 1', finish_reason='length'),
    g('Sure! The capital of Japan is Tokyo. The capital of Japan is Tokyo. The capital of Japan is Tokyo. The capital of Japan is Tokyo.', 'Capital of Japan?', 'third batch, written blind 2', finish_reason='length'),
    g('The capital of Japan is Tokyo.<|im_end|>', 'Capital of Japan?', 'third batch, written blind 3', finish_reason='stop'),
    g('The capital of Japan is Tokyo.\n\nuser: thanks!', 'Capital of Japan?', 'third batch, written blind 4', finish_reason='stop'),
    g('The capital of Japan is', 'Capital of Japan?', 'third batch, written blind 5', finish_reason='stop'),
    g('The capital of Japan is Tokyo. Токио является столицей Японии и крупнейшим городом.', 'Capital of Japan?', 'third batch, written blind 6', finish_reason='stop'),
    g('Tokyo�', 'Capital of Japan?', 'third batch, written blind 7', finish_reason='stop'),
    g('Tokyo\x03', 'Capital of Japan?', 'third batch, written blind 8', finish_reason='stop'),
    g('TÅ\x8dkyÅ\x8d is the capital.', 'Capital of Japan?', 'third batch, written blind 9', finish_reason='stop'),
    g('1. Tokyo 1. Tokyo 1. Tokyo 1. Tokyo 1. Tokyo', 'Capital of Japan?', 'third batch, written blind 10', finish_reason='length'),
    g('<think>\nThe capital of Japan is Tokyo.\n</think>\n\nTokyo.', 'Capital of Japan?', 'third batch, written blind 11', finish_reason='stop', thinking=False),
    g('Tokyo Tokyo Tokyo Tokyo Tokyo Tokyo Tokyo Tokyo', 'Capital of Japan?', 'third batch, written blind 12', finish_reason='length'),
    g('The capital of Japan is Tokyo. It is a large city with many people. It is a large city with many people.', 'Capital of Japan?', 'third batch, written blind 13', finish_reason='length'),
    g('Tokyo.\n\n### Instruction:\nWhat is the capital of Korea?', 'Capital of Japan?', 'third batch, written blind 14', finish_reason='stop'),
]

# Fourth batch, written before running the detector on it.
GARBLED += [
    g('Olá! Claro, posso ajudar. O Brasil tem 26 estados e 一个联邦区。', 'Quantos estados tem o Brasil?', 'fourth batch, written blind 1', finish_reason='stop'),
    g("Certo! La capitale d'Italia è Roma, Roma, Roma, Roma, Roma, Roma, Roma, Roma", "Qual è la capitale d'Italia?", 'fourth batch, written blind 2', finish_reason='length'),
    g('Stolicą Polski jest<|im_end|>', 'Jaka jest stolica Polski?', 'fourth batch, written blind 3', finish_reason='stop'),
    g('भारत की राजधानी नई दिल्ली है। The capital of India is New Delhi. भारत की राजधानी नई दिल्ली है। The capital of India is New Delhi. भारत की राजधानी नई दिल्ली है। The capital of India is New Delhi.', 'भारत की राजधानी क्या है?', 'fourth batch, written blind 4', finish_reason='length'),
    g('عاصمة مصر هي', 'ما هي عاصمة مصر؟', 'fourth batch, written blind 5', finish_reason='stop'),
    g('```cpp\n#include <iostream>\n#include <iostream>\n#include <iostream>\n#include <iostream>\n#include <iostream>\n#include <iostream>\n#include <iostream>\n#include <iostream>\n#include <iostream>', 'C++ vector loop', 'fourth batch, written blind 6', finish_reason='length'),
    g('```java\npublic class Main {\n    public static void main(String[] args) {\n        System.out.println("Hello");<|endoftext|>', 'Java hello', 'fourth batch, written blind 7', finish_reason='stop'),
    g('id,name,score\n1,alice,90\n1,alice,90\n1,alice,90\n1,alice,90\n1,alice,90\n1,alice,90\n1,alice,90', 'Give me sample CSV data', 'fourth batch, written blind 8', finish_reason='length'),
    g("Sure! Here's a tongue twister: She sells seashells by the seashore. She sells seashells by the seashore. She sells seashells by the seashore. She sells seashells by the seashore.", 'Tongue twister?', 'fourth batch, written blind 9', finish_reason='length'),
    g('Happy New Year! 新年快乐！🎆\nuser\nthanks\nassistant\n', 'Wish me happy new year in English and Chinese', 'fourth batch, written blind 10', finish_reason='stop'),
    g('Yes.\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n', 'Is it?', 'fourth batch, written blind 11', finish_reason='length'),
    g('The password must contain: 1) 8+ characters, 2) 2) 2) 2) 2) 2)', 'Password rules?', 'fourth batch, written blind 12', finish_reason='length'),
    g('Dear team,\n\nPlease find the report attached.\n\nBest,\nSam\n\nHuman: Thanks Sam!\n\nAssistant:', 'Short email with attachment', 'fourth batch, written blind 13', finish_reason='stop'),
    g('Столиця України — Київ. Kyiv is the столиця and 首都 of Україна.', 'Яка столиця України?', 'fourth batch, written blind 14', finish_reason='stop'),
    g('Thủ đô của Việt Nam là Hà Nội. Hà Nội Hà Nội Hà Nội Hà Nội Hà Nội Hà Nội Hà Nội', 'Thủ đô của Việt Nam là gì?', 'fourth batch, written blind 15', finish_reason='length'),
]

# Loops after a good start: take a clean English/Chinese answer, keep its first part, then loop.
_LOOP_BASES = [
    ("Photosynthesis is the process by which green plants turn light into chemical energy.",
     "Explain photosynthesis briefly.", ["It is a process. ", "and the light and the ", "the plants "]),
    ("Speculative decoding lets a small draft model propose tokens that the target verifies.",
     "What is speculative decoding?", ["the draft model ", "which is verified by the target model which is verified by the target model ", "verify "]),
    ("Rust guarantees memory safety through ownership and borrowing.", "Explain Rust ownership.",
     ["The owner is the owner. ", "borrow ", "and the borrow checker checks the borrow checker "]),
    ("The French Revolution began in 1789.", "Summarize the French Revolution.",
     ["The revolution was a revolution. ", "and then the ", "in France in France "]),
    ("Hello! It's great to meet you.", STORY_PROMPT, ["Hello! ", "It's great to meet you. ", "great "]),
    ("北京是中国的首都，", "中国的首都是哪里？", ["也是首都", "北京是", "的首都的首都"]),
    ("To reset your password, open Settings and choose Account.", "How do I reset my password?",
     ["Then choose Account. ", "open Settings and open Settings and ", "Account "]),
    ("Madrid es la capital de España.", "¿Cuál es la capital de España?", ["Es la capital. ", "de España de España ", "capital "]),
    ("Berlin ist die Hauptstadt von Deutschland.", "Was ist die Hauptstadt Deutschlands?",
     ["Berlin ist die Hauptstadt. ", "und die Stadt ", "von Deutschland "]),
    ("Москва — столица России.", "Какая столица России?", ["Москва — столица. ", "столица России ", "и "]),
]


def _generated_garbled(rng: random.Random) -> list[dict]:
    out = []
    for start, prompt, units in _LOOP_BASES:
        for unit in units:
            repeats = rng.randint(5, 12)
            text = start + " " + unit * repeats
            cut = rng.randint(0, max(0, len(unit) - 2))
            text = text + unit[:cut]
            out.append(g(text.rstrip(), prompt, f"good start then a loop of {unit.strip()[:20]!r}",
                         finish_reason="length"))
    return out


def build() -> tuple[list[dict], list[dict]]:
    rng = random.Random(7)
    clean = CLEAN + _generated_clean(rng)
    garbled = GARBLED + _generated_garbled(rng)
    return clean, garbled


def main() -> None:
    clean, garbled = build()
    for name, rows in (("clean.jsonl", clean), ("garbled.jsonl", garbled)):
        with open(HERE / name, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"clean={len(clean)} garbled={len(garbled)}")


if __name__ == "__main__":
    main()
